"""The lab's machines run Podman as a real machine does, and stay machines of their own: a sysfs that
lists only their links, an /etc whose changes stay on the machine, container storage of their own."""
import io
import shutil
import tarfile
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.lab

LAB_A, LAB_B = "198.18.0.11", "198.18.0.12"


def on(lab, address: str, command: str, timeout: float = 60) -> str:
    result = lab.ssh(address, command, timeout=timeout)
    assert result.returncode == 0, f"{command}: {result.stderr or result.stdout}"
    return result.stdout


@pytest.fixture(scope="module")
def busybox(lab):
    """A busybox root file system as a tar in lab-a's own directory (its /run/fadenstack-lab)."""
    busybox = shutil.which("busybox") or "/bin/busybox"
    if not Path(busybox).exists():
        pytest.skip("busybox-static is needed for a container image made offline")
    path = Path(lab.state_dir) / "machines" / "lab-a" / "busybox.tar"
    with tarfile.open(path, "w") as tar:
        tar.add(busybox, arcname="bin/busybox")
        for applet in ("sh", "ls", "cat"):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link, io.BytesIO())
    yield "/run/fadenstack-lab/busybox.tar"
    path.unlink(missing_ok=True)


def test_a_machine_s_sysfs_lists_only_its_own_links_and_keeps_the_cgroups(lab):
    assert on(lab, LAB_A, "ls /sys/class/net").split() == ["eth0", "eth1", "eth2", "lo", "wg0"]
    assert on(lab, "198.18.0.15", "ls /sys/class/net").split() == ["eth0", "lo"]
    assert on(lab, LAB_A, "ls /sys/fs/cgroup").split()  # the cgroup tree runc needs is there


def test_what_is_written_to_a_machine_s_etc_stays_on_that_machine(lab):
    name = f"written-by-a-test-{uuid.uuid4().hex[:8]}"
    on(lab, LAB_A, f"echo lab-a > /etc/{name}")

    assert on(lab, LAB_A, f"cat /etc/{name}").strip() == "lab-a"
    assert lab.ssh(LAB_B, f"test -e /etc/{name}").returncode != 0
    assert not Path("/etc", name).exists()  # the host's /etc is unchanged


def test_podman_runs_a_container_that_sees_the_machine_s_links_and_keeps_its_images_apart(lab, busybox):
    tag = f"localhost/lab-test-{uuid.uuid4().hex[:8]}:1"
    on(lab, LAB_A, f"podman import -q {busybox} {tag}")
    try:
        seen = on(lab, LAB_A, f"podman run --rm --network host {tag} ls /sys/class/net")
        assert seen.split() == ["eth0", "eth1", "eth2", "lo", "wg0"]
        info = on(lab, LAB_A, "podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.CgroupManager}}'")
        assert info.split() == ["runc", "cgroupfs"]
        assert tag not in on(lab, LAB_B, "podman images --format '{{.Repository}}:{{.Tag}}'")
    finally:
        lab.ssh(LAB_A, f"podman rmi -f {tag}")
