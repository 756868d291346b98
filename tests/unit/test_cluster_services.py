"""Creating and starting clusters, short of the machines: the checks, the messages, what a failure leads to."""
import pytest
from django.core.exceptions import ValidationError

from clusters import choosing, services
from clusters.choices import ClusterState
from clusters.models import Cluster, RuntimeImage
from tests.builders import gpu_machine

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def build_not_held(tmp_path):
    """A build the database knows but whose file the server no longer holds."""
    return RuntimeImage.objects.create(name="NVIDIA x86_64 Runtime", version="2.1.0", digest="c" * 64, size_bytes=1024,
                                       arch="x86_64", accelerator_vendor="nvidia", path=str(tmp_path / "gone.img"))


def test_a_build_the_server_does_not_hold_makes_the_cluster_wait_instead_of_retrying(build_not_held):
    a, b = gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)

    cluster = services.cluster_create(name="gpu-room", machine_ids=[a.pk, b.pk], head_id=a.pk, network="198.18.1.0/24")

    cluster.refresh_from_db()
    assert cluster.state == ClusterState.WAITING
    assert cluster.state_reason.startswith("This will not change by retrying:")
    assert "faden runtime-images --check" in cluster.state_reason
    assert cluster.next_retry_at is None


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("", "Enter a cluster name."),
        ("GPU-room", "lowercase letters, digits and hyphens"),
        ("-gpu", "starts and ends with a letter or a digit"),
        ("a" * 64, "at most 63 characters"),
    ],
)
def test_a_bad_cluster_name_is_refused_with_the_rule_it_broke(name, words):
    with pytest.raises(ValidationError) as refused:
        choosing.cluster_name_check(name)
    assert words in " ".join(refused.value.messages)


def test_a_taken_name_is_refused(build_not_held):
    Cluster.objects.create(name="gpu-room")
    with pytest.raises(ValidationError, match="already a cluster named gpu-room"):
        choosing.cluster_name_check("gpu-room")


def test_a_network_the_machines_do_not_all_share_is_refused_and_nothing_is_stored(build_not_held):
    a, b = gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)

    with pytest.raises(ValidationError) as refused:
        services.cluster_create(name="gpu-room", machine_ids=[a.pk, b.pk], head_id=a.pk, network="198.18.7.0/24")

    assert "not a network all of these machines share" in " ".join(refused.value.messages)
    assert not Cluster.objects.exists()


def test_a_machine_in_another_cluster_cannot_be_picked(build_not_held):
    a, b = gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)
    services.cluster_create(name="first", machine_ids=[a.pk], head_id=a.pk, network="198.18.1.0/24")

    with pytest.raises(ValidationError) as refused:
        services.cluster_create(name="second", machine_ids=[a.pk, b.pk], head_id=b.pk, network="198.18.1.0/24")

    assert "gpu-a is in the cluster first: take it out of that cluster before you pick it." in refused.value.messages
