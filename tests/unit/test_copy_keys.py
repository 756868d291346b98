"""Each copy's own key: made once, sealed and bound to its copy, given to the engine by its environment
(never its command line), and sent by the gateway in place of the client's key; a copy started before copies
had keys gets nothing."""
import pytest

from deployments import copy_keys, services
from deployments.models import Copy
from tests.builders import deployment_of
from tests.unit.test_deployments import ask, fakes, model, starts  # noqa: F401 (fixtures)
from tests.unit.test_deployments import cluster as three_machines  # noqa: F401
from tests.unit.test_gateway import a_key, answered_by, chat, cluster, redis, serving, start_gateway, upstreams  # noqa: F401
from tests.factories import UserFactory
from console import roles

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_key_is_made_once_sealed_and_unseals_only_for_its_own_copy(cluster):  # noqa: F811
    copy = serving(deployment_of(cluster, name="llama"), 1)
    key = copy_keys.copy_key_ensure(copy)
    assert len(key) >= 40 and key not in copy.api_key_sealed
    stored = Copy.objects.get(pk=copy.pk)
    assert copy_keys.copy_key_of(copy.pk, stored.api_key_sealed) == key
    assert copy_keys.copy_key_of(copy.pk + 1, stored.api_key_sealed) is None      # moved to another row: nothing
    assert copy_keys.copy_key_ensure(stored) == key                               # kept across starts
    assert copy_keys.copy_key_ensure(serving(copy.deployment, 2, number=2)) != key


def test_the_engine_gets_its_key_in_its_environment_never_its_command_line(three_machines, model, fakes):  # noqa: F811
    deployment = services.deployment_create(ask=ask(three_machines, model, copies=1), user=UserFactory(role=roles.OPERATOR))
    (copy,) = deployment.copy_rows.all()
    ((_, kw),) = starts(fakes)
    key = copy_keys.copy_key_of(copy.pk, copy.api_key_sealed)
    assert key and kw["env"]["VLLM_API_KEY"] == key
    assert not any(key in word for word in kw["argv"])


def test_the_gateway_sends_the_copy_s_key_not_the_client_s_and_none_to_a_copy_without_one(
        cluster, upstreams, start_gateway):  # noqa: F811
    keyed, old = upstreams("keyed"), upstreams("old")
    llama = deployment_of(cluster, name="llama")
    copy_key = copy_keys.copy_key_ensure(serving(llama, keyed, 1))
    serving(llama, old, 2)  # started before copies had keys
    secret = a_key()
    client = start_gateway().client(secret)
    assert {answered_by(chat(client, "llama")) for _ in range(4)} == {"keyed", "old"}
    sent = {name.lower(): value for name, value in keyed.requests[0]["headers"].items()}
    assert sent["authorization"] == f"Bearer {copy_key}" and secret not in str(keyed.requests[0]["headers"])
    assert "authorization" not in {name.lower() for name in old.requests[0]["headers"]}
