"""Pure planning for clusters: picking machines, the head, the network and who sends the image to whom."""
import ipaddress
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusters.planning import (
    NO_RUNTIME,
    NO_SHARED_NETWORK,
    SERVER,
    Candidate,
    Iface,
    ImageBuild,
    NetworkMember,
    Receiver,
    SharedNetwork,
    distribution_plan,
    pick_check,
    retry_pause,
    runtime_for,
    shared_networks,
    suggest_head,
    suggest_network,
)

# 100 examples a property in the suite (it shares the host's two cores with the lab's worker);
# FADEN_HYPOTHESIS_EXAMPLES=2000 pytest this file searches deeper, as a run of its own.
MANY = settings(max_examples=int(os.environ.get("FADEN_HYPOTHESIS_EXAMPLES", "100")), deadline=None)

# ------------------------------------------------------------------ the default lab (lab/specs/default.toml)

LAB_NETWORKS = {  # name: (interface, third octet, rate, carries the default route)
    "mgmt": ("eth0", 0, 200, True),
    "fabric": ("eth1", 1, 400, False),
    "slow": ("eth2", 2, 40, False),
    "wg0": ("wg0", 3, 350, False),
}


def lab_machine(
    index, name, networks, arch="x86_64", vendor="nvidia", count=8, model="NVIDIA H100 80GB HBM3", state="healthy",
    **extra,
):
    host = 11 + index
    interfaces = tuple(
        Iface(
            name=LAB_NETWORKS[n][0],
            addresses=(f"198.18.{LAB_NETWORKS[n][1]}.{host}/24", f"fe80::{host}/64"),
            speed_mbps=10000,
            kind="vpn" if n == "wg0" else "physical",
            default_route=LAB_NETWORKS[n][3],
        )
        for n in networks
    ) + (Iface(name="lo", addresses=("127.0.0.1/8", "::1/128"), kind="loopback"),)
    return Candidate(
        id=index + 1, name=name, state=state, arch=arch, accelerator_vendor=vendor, accelerator_count=count,
        accelerator_model=model, interfaces=interfaces, ssh_address=f"198.18.0.{host}",
        **{"container_runtime": "process", **extra},  # the lab's machines run the process driver
    )


LAB_A = lab_machine(0, "lab-a", ["mgmt", "fabric", "slow", "wg0"])
LAB_B = lab_machine(1, "lab-b", ["mgmt", "fabric", "slow", "wg0"])
LAB_C = lab_machine(2, "lab-c", ["mgmt", "fabric", "wg0"], count=4, model="NVIDIA A100-SXM4-40GB")
LAB_D = lab_machine(3, "lab-d", ["mgmt", "fabric"], arch="aarch64", count=4, model="NVIDIA GH200 96GB")
LAB_E = lab_machine(4, "lab-e", ["mgmt"], vendor="amd", model="AMD Instinct MI300X")
NVIDIA_BUILDS = (
    ImageBuild(id=1, arch="x86_64", accelerator_vendor="nvidia", version="2.1.0"),
    ImageBuild(id=2, arch="aarch64", accelerator_vendor="nvidia", version="2.1.0"),
)
LAB_MEASURED = {"198.18.1.0/24": 380.0, "198.18.3.0/24": 330.0, "198.18.2.0/24": 38.0, "198.18.0.0/24": 190.0}


def by_subnet(networks):
    return {n.subnet: n for n in networks}


def test_lab_a_and_lab_b_share_mgmt_fabric_slow_and_wg0():
    networks = shared_networks([LAB_A, LAB_B])
    assert [n.subnet for n in networks] == ["198.18.0.0/24", "198.18.1.0/24", "198.18.2.0/24", "198.18.3.0/24"]


def test_the_lab_mgmt_network_is_marked_management_and_wg0_vpn_like():
    networks = by_subnet(shared_networks([LAB_A, LAB_B]))
    assert networks["198.18.0.0/24"].management and not networks["198.18.0.0/24"].vpn
    assert networks["198.18.3.0/24"].vpn and not networks["198.18.3.0/24"].management
    assert not any(networks[s].management or networks[s].vpn for s in ("198.18.1.0/24", "198.18.2.0/24"))


def test_shared_network_lists_each_machine_with_its_interface_and_address_without_prefix():
    fabric = by_subnet(shared_networks([LAB_A, LAB_B]))["198.18.1.0/24"]
    assert fabric.members == (
        NetworkMember(1, "eth1", "198.18.1.11", 10000), NetworkMember(2, "eth1", "198.18.1.12", 10000)
    )
    assert fabric.address_of(2) == "198.18.1.12"


def test_the_wizard_suggests_fabric_over_the_vpn_and_management_in_the_lab():
    assert suggest_network(shared_networks([LAB_A, LAB_B]), LAB_MEASURED) == "198.18.1.0/24"


def test_the_wizard_suggests_fabric_even_when_wg0_measures_faster():
    measured = dict(LAB_MEASURED, **{"198.18.3.0/24": 900.0, "198.18.0.0/24": 950.0})
    assert suggest_network(shared_networks([LAB_A, LAB_B]), measured) == "198.18.1.0/24"


def test_lab_e_shares_only_mgmt_with_lab_a_so_management_is_the_only_suggestion():
    networks = shared_networks([LAB_A, LAB_E])
    assert [n.subnet for n in networks] == ["198.18.0.0/24"]
    assert suggest_network(networks, {}) == "198.18.0.0/24"


def test_a_network_holding_the_console_address_is_management_even_without_a_default_route():
    plain = Candidate(id=1, name="gpu-1", interfaces=(Iface("eth5", ("10.0.0.5/24",)),))
    assert not shared_networks([plain])[0].management
    assert shared_networks([plain], console_addresses=["10.0.0.1/24"])[0].management


def test_a_network_holding_the_ssh_address_is_management():
    plain = Candidate(id=1, name="gpu-1", ssh_address="10.0.0.5", interfaces=(Iface("eth5", ("10.0.0.5/24",)),))
    assert shared_networks([plain])[0].management


@pytest.mark.parametrize("name", ["wg1", "tun0", "tap3", "tailscale0", "ztabc", "ppp0", "ipsec0", "utun2", "nebula1"])
def test_an_interface_named_like_a_tunnel_makes_its_network_vpn_like(name):
    machine = Candidate(id=1, name="gpu-1", interfaces=(Iface(name, ("10.0.0.5/24",), kind="physical"),))
    assert shared_networks([machine])[0].vpn


def test_machines_with_no_network_in_common_share_none():
    assert shared_networks([LAB_E, lab_machine(5, "lab-f", ["fabric"])]) == []
    assert suggest_network([], {}) is None
    assert NO_SHARED_NETWORK == "These machines cannot form a cluster yet."


def test_one_machine_shares_every_network_it_has_but_loopback_and_link_local():
    assert [n.subnet for n in shared_networks([LAB_A])] == [
        "198.18.0.0/24", "198.18.1.0/24", "198.18.2.0/24", "198.18.3.0/24"
    ]


def test_lab_a_is_suggested_as_head_over_lab_b_with_as_many_accelerators():
    assert suggest_head([LAB_B, LAB_D, LAB_A]) == LAB_A.id


def test_lab_e_is_refused_when_only_nvidia_runtimes_exist():
    verdict = pick_check([LAB_A, LAB_E], NVIDIA_BUILDS, head_id=LAB_A.id)[LAB_E.id]
    assert not verdict.selectable
    assert verdict.refusal == "No certified runtime image runs on lab-e (AMD Instinct MI300X, x86_64)."
    assert verdict.refusal.startswith(NO_RUNTIME)
    assert verdict.runtime_label == ""


def test_lab_d_on_arm_is_pickable_with_a_warning_when_lab_a_leads():
    verdicts = pick_check([LAB_A, LAB_D], NVIDIA_BUILDS, head_id=LAB_A.id)
    assert verdicts[LAB_D.id].selectable
    assert verdicts[LAB_D.id].warning == (
        "lab-d is aarch64, the head is x86_64: it runs another runtime image, and no copy of a model spans both kinds."
    )
    assert verdicts[LAB_D.id].runtime_label == "runs NVIDIA aarch64 Runtime 2.x"
    assert verdicts[LAB_A.id].warning == ""


def test_no_warning_about_architecture_before_a_head_is_chosen():
    assert pick_check([LAB_A, LAB_D], NVIDIA_BUILDS)[LAB_D.id].warning == ""


def test_a_machine_in_another_cluster_is_refused_with_the_cluster_name():
    verdict = pick_check([lab_machine(0, "lab-a", ["fabric"], cluster_name="gpu-room")], NVIDIA_BUILDS)[1]
    assert not verdict.selectable
    assert verdict.refusal == "lab-a is in the cluster gpu-room: take it out of that cluster before you pick it."


def test_an_offline_machine_is_refused_with_its_state_and_reason():
    offline = lab_machine(1, "lab-b", ["fabric"], state="offline", state_reason="No heartbeat for 40 s.")
    verdict = pick_check([offline], NVIDIA_BUILDS)[offline.id]
    assert not verdict.selectable
    assert verdict.refusal == "lab-b is Offline: No heartbeat for 40 s."


def test_a_state_label_from_the_caller_is_used_as_written():
    waiting = lab_machine(1, "lab-b", ["fabric"], state="host_key", state_label="Host key to confirm")
    assert pick_check([waiting], NVIDIA_BUILDS)[waiting.id].refusal == "lab-b is Host key to confirm."


def test_a_healthy_machine_with_a_runtime_is_selectable_and_names_its_runtime():
    verdict = pick_check([LAB_A], NVIDIA_BUILDS)[LAB_A.id]
    assert verdict == pick_check([LAB_A], NVIDIA_BUILDS)[LAB_A.id]
    assert verdict.selectable and verdict.refusal == "" and verdict.runtime_label == "runs NVIDIA x86_64 Runtime 2.x"


def test_the_amd_runtime_label_names_amd_as_people_write_it():
    amd = ImageBuild(id=9, arch="x86_64", accelerator_vendor="amd", version="2.0.3")
    assert pick_check([LAB_E], [amd])[LAB_E.id].runtime_label == "runs AMD x86_64 Runtime 2.x"


def test_runtime_for_takes_the_newest_certified_build_of_the_major_for_the_platform():
    builds = [
        ImageBuild(1, "x86_64", "nvidia", "2.9.0"),
        ImageBuild(2, "x86_64", "nvidia", "2.10.0"),
        ImageBuild(3, "x86_64", "nvidia", "2.11.0", certified=False),
        ImageBuild(4, "x86_64", "nvidia", "3.0.0"),
        ImageBuild(5, "aarch64", "nvidia", "2.12.0"),
        ImageBuild(6, "x86_64", "amd", "2.12.0"),
    ]
    assert runtime_for(LAB_A, builds).id == 2
    assert runtime_for(LAB_A, builds, major="3").id == 4
    assert runtime_for(LAB_A, builds, major="4") is None


def test_retry_pauses_grow_from_ten_seconds_to_at_most_fifteen_minutes():
    pauses = [retry_pause(attempt) for attempt in range(1, 40)]
    assert pauses[:4] == [10, 20, 40, 80]
    assert pauses == sorted(pauses) and max(pauses) == 900 and pauses[-1] == 900


# ------------------------------------------------------------------ the head, by the hundreds

candidate_lists = st.lists(
    st.builds(
        Candidate,
        id=st.integers(0, 10_000),
        name=st.text("abc-", min_size=1, max_size=4),
        accelerator_count=st.integers(0, 16),
    ),
    min_size=1,
    max_size=12,
    unique_by=(lambda c: c.id, lambda c: c.name),
)


@MANY
@given(candidates=candidate_lists, data=st.data())
def test_suggest_head_is_the_same_in_any_order_and_has_the_most_accelerators(candidates, data):
    shuffled = data.draw(st.permutations(candidates))
    head = suggest_head(candidates)
    assert suggest_head(shuffled) == head
    chosen = next(c for c in candidates if c.id == head)
    assert chosen.accelerator_count == max(c.accelerator_count for c in candidates)
    assert chosen.name == min(c.name for c in candidates if c.accelerator_count == chosen.accelerator_count)


# ------------------------------------------------------------------ shared networks, by the hundreds

SUBNET_POOL = [
    "10.0.0.0/24", "10.0.1.0/24", "10.0.0.0/16", "192.168.7.0/24", "172.16.0.0/30",
    "2001:db8:1::/64", "2001:db8:2::/64", "169.254.0.0/16", "fe80::/64", "127.0.0.0/8",
]


@st.composite
def machines_on_subnets(draw):
    count = draw(st.integers(1, 5))
    machines = []
    for index in range(count):
        subnets = draw(st.lists(st.sampled_from(SUBNET_POOL), max_size=6))
        interfaces = []
        for number, subnet in enumerate(subnets):
            network = ipaddress.ip_network(subnet)
            host = network[min(index + 1, network.num_addresses - 1)]
            interfaces.append(Iface(
                name=draw(st.sampled_from(["eth", "ens", "wg", "tun", "bond"])) + str(number),
                addresses=(f"{host}/{network.prefixlen}",),
                speed_mbps=draw(st.none() | st.integers(1, 100_000)),
                kind=draw(st.sampled_from(["physical", "bridge", "vpn", "virtual"])),
                default_route=draw(st.booleans()),
            ))
        machines.append(Candidate(id=index, name=f"gpu-{index}", interfaces=tuple(interfaces)))
    return machines


def brute_force_shared(machines):
    def usable(text):
        interface = ipaddress.ip_interface(text)
        return not (interface.ip.is_link_local or interface.ip.is_loopback)

    per_machine = [
        {str(ipaddress.ip_network(a, strict=False)) for i in m.interfaces for a in i.addresses if usable(a)}
        for m in machines
    ]
    return set.intersection(*per_machine)


@MANY
@given(machines=machines_on_subnets())
def test_shared_networks_are_exactly_the_subnets_every_machine_has_an_address_on(machines):
    networks = shared_networks(machines)
    assert {n.subnet for n in networks} == brute_force_shared(machines)
    assert len(networks) == len({n.subnet for n in networks})


@MANY
@given(machines=machines_on_subnets())
def test_every_shared_network_lists_each_machine_once_with_an_address_inside_it(machines):
    for network in shared_networks(machines):
        assert [m.machine_id for m in network.members] == [m.id for m in machines]
        for member in network.members:
            assert ipaddress.ip_address(member.address) in ipaddress.ip_network(network.subnet)


@MANY
@given(machines=machines_on_subnets(), data=st.data())
def test_shared_networks_come_in_the_same_order_whatever_the_order_of_the_machines(machines, data):
    shuffled = data.draw(st.permutations(machines))
    assert [n.subnet for n in shared_networks(shuffled)] == [n.subnet for n in shared_networks(machines)]


# ------------------------------------------------------------------ the suggested network, by the hundreds

@st.composite
def networks_and_measurements(draw):
    thirds = draw(st.lists(st.integers(0, 255), unique=True, max_size=8))
    networks, measured = [], {}
    for third in sorted(thirds):
        subnet = f"10.1.{third}.0/24"
        speed = draw(st.none() | st.sampled_from([100, 1000, 10000, 25000]))
        networks.append(SharedNetwork(
            subnet=subnet,
            members=(NetworkMember(1, "eth1", f"10.1.{third}.1", speed),),
            management=draw(st.booleans()),
            vpn=draw(st.booleans()),
        ))
        if draw(st.booleans()):
            measured[subnet] = draw(st.sampled_from([38.0, 190.0, 330.0, 380.0, 900.0]))
    return networks, measured


def dedicated(network):
    return not network.management and not network.vpn


@MANY
@given(case=networks_and_measurements())
def test_the_suggestion_is_the_fastest_measured_dedicated_network_when_there_is_one(case):
    networks, measured = case
    candidates = [n for n in networks if dedicated(n) and n.subnet in measured]
    suggestion = suggest_network(networks, measured)
    if candidates:
        fastest = max(measured[n.subnet] for n in candidates)
        assert suggestion in {n.subnet for n in candidates}
        assert measured[suggestion] == fastest
        assert suggestion == min(n.subnet for n in candidates if measured[n.subnet] == fastest)


@MANY
@given(case=networks_and_measurements())
def test_management_or_vpn_is_never_suggested_while_a_dedicated_network_exists(case):
    networks, measured = case
    suggestion = suggest_network(networks, measured)
    if any(dedicated(n) for n in networks):
        assert dedicated(next(n for n in networks if n.subnet == suggestion))


@MANY
@given(case=networks_and_measurements())
def test_a_network_is_suggested_whenever_there_is_one(case):
    networks, measured = case
    suggestion = suggest_network(networks, measured)
    assert (suggestion is None) == (not networks)
    assert suggestion is None or suggestion in {n.subnet for n in networks}


def test_without_measurements_the_fastest_dedicated_link_is_suggested():
    def network(subnet, speed, **marks):
        members = (NetworkMember(1, "eth", subnet[:-3], speed), NetworkMember(2, "eth", "x", 100_000))
        return SharedNetwork(subnet, members, **marks)

    networks = [network("10.0.0.0/24", 100_000, management=True), network("10.0.1.0/24", 1000),
                network("10.0.2.0/24", 25_000), network("10.0.3.0/24", 100_000, vpn=True)]
    assert suggest_network(networks, {}) == "10.0.2.0/24"


def test_with_only_management_and_vpn_the_fastest_measured_of_them_is_suggested():
    networks = [SharedNetwork("10.0.0.0/24", (), management=True), SharedNetwork("10.0.1.0/24", (), vpn=True)]
    assert suggest_network(networks, {"10.0.0.0/24": 100.0, "10.0.1.0/24": 300.0}) == "10.0.1.0/24"
    assert suggest_network(networks, {}) == "10.0.0.0/24"


# ------------------------------------------------------------------ the distribution plan, by the hundreds

receiver_lists = st.lists(
    st.builds(
        Receiver,
        id=st.integers(0, 1000),
        platform=st.sampled_from(["nvidia/x86_64", "nvidia/aarch64", "amd/x86_64"]),
        has_image=st.booleans(),
    ),
    max_size=15,
    unique_by=lambda r: r.id,
)


@MANY
@given(receivers=receiver_lists)
def test_every_machine_without_the_image_receives_it_exactly_once_and_holders_never_do(receivers):
    plan = distribution_plan(receivers)
    assert sorted(t.machine_id for t in plan) == sorted(r.id for r in receivers if not r.has_image)


@MANY
@given(receivers=receiver_lists)
def test_the_server_sends_one_copy_per_platform_nobody_holds_and_none_otherwise(receivers):
    plan = distribution_plan(receivers)
    platform = {r.id: r.platform for r in receivers}
    from_server = [platform[t.machine_id] for t in plan if t.source == SERVER]
    needed = {r.platform for r in receivers} - {r.platform for r in receivers if r.has_image}
    assert sorted(from_server) == sorted(needed)


@MANY
@given(receivers=receiver_lists)
def test_every_source_holds_the_image_or_received_it_earlier_on_the_same_platform(receivers):
    platform = {r.id: r.platform for r in receivers}
    holding = {r.id for r in receivers if r.has_image}
    for transfer in distribution_plan(receivers):
        assert transfer.source != transfer.machine_id
        if transfer.source != SERVER:
            assert transfer.source in holding
            assert platform[transfer.source] == platform[transfer.machine_id]
        holding.add(transfer.machine_id)


@MANY
@given(receivers=receiver_lists)
def test_the_plan_is_a_chain_where_no_source_sends_more_than_one_copy(receivers):
    # The bound: each machine, and the server per platform, is the source of at most one transfer.
    platform = {r.id: r.platform for r in receivers}
    sources = [(t.source, platform[t.machine_id]) if t.source == SERVER else (t.source, None)
               for t in distribution_plan(receivers)]
    assert len(sources) == len(set(sources))


@MANY
@given(receivers=receiver_lists)
def test_when_nobody_holds_the_image_the_server_sends_it_to_the_first_machine_of_the_platform(receivers):
    plan = {t.machine_id: t.source for t in distribution_plan(receivers)}
    for name in {r.platform for r in receivers}:
        of_platform = [r for r in receivers if r.platform == name]
        if not any(r.has_image for r in of_platform):
            assert plan[of_platform[0].id] == SERVER


def test_three_machines_fetch_in_a_chain_from_the_head():
    plan = distribution_plan([Receiver("lab-a", "nvidia/x86_64"), Receiver("lab-b", "nvidia/x86_64"),
                              Receiver("lab-c", "nvidia/x86_64"), Receiver("lab-d", "nvidia/aarch64")])
    assert [(t.machine_id, t.source) for t in plan] == [
        ("lab-a", SERVER), ("lab-b", "lab-a"), ("lab-c", "lab-b"), ("lab-d", SERVER)
    ]


def test_a_machine_added_later_fetches_from_a_member_that_holds_the_image():
    plan = distribution_plan([
        Receiver("lab-a", "nvidia/x86_64", has_image=True),
        Receiver("lab-c", "nvidia/x86_64"),
    ])
    assert [(t.machine_id, t.source) for t in plan] == [("lab-c", "lab-a")]
