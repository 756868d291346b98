"""Engine options are an allowlist: exact vLLM flags for an Operator, the ones that run code or read files
for an Administrator (recorded in the audit trail), abbreviations refused, a deployment recorded before
the allowlist kept running until it is edited."""
import pytest
from django.core.exceptions import ValidationError

from console import roles
from console.models import AuditEntry
from deployments import services
from deployments.engine import ADMINISTRATOR_OPTIONS, CONSOLE_FLAGS, OPERATOR_OPTIONS, options_problem, vllm_command
from deployments.models import Deployment
from tests.factories import UserFactory
from tests.unit.test_deployments import ask, cluster, fakes, model  # noqa: F401 (fixtures)

COMMON = dict(model_dir="/m", name="chat", address="198.18.1.11", port=8100, vendor="nvidia",
              memory_per_gpu_mib=1000, gpu_memory_mib=2000, context_length=4096)


def test_the_three_lists_do_not_overlap():
    assert not OPERATOR_OPTIONS & ADMINISTRATOR_OPTIONS
    assert not (OPERATOR_OPTIONS | ADMINISTRATOR_OPTIONS) & CONSOLE_FLAGS


@pytest.mark.parametrize("options", [
    ["--enable-prefix-caching"], ["--kv-cache-dtype=fp8"], ["--max-num-seqs=64", "--enforce-eager"],
    ["--dtype=bfloat16", "--quantization=fp8", "--max-num-batched-tokens=8192"],
])
def test_an_operator_may_give_the_allowed_flags_alone_or_with_a_value(options):
    assert options_problem(options) is None


@pytest.mark.parametrize("options, words", [
    (["--hos=0.0.0.0"], "--hos is not a whole engine option: write it in full (--host)"),
    (["--max-model=9"], "write it in full (--max-model-len)"),
    (["--enable-prefix"], "write it in full (--enable-prefix-caching)"),
    (["--trust-remote"], "write it in full (--trust-remote-code)"),
    (["--api-key=x"], "--api-key is set by the console"),
    (["--ssl-cert-reqs=0"], "--ssl-cert-reqs is set by the console"),
    (["--tensor-parallel-size=8"], "set by the console"),
    (["--no-such-flag"], "is not an engine option the console allows"),
    (["--trust-remote-code"], "--trust-remote-code is an Administrator's decision"),
    (["--chat-template=/etc/shadow"], "--chat-template is an Administrator's decision"),
    (["--config=/x.yaml"], "an Administrator's decision"),
])
def test_abbreviations_unknown_console_and_administrator_flags_are_refused_for_an_operator(options, words):
    assert words in options_problem(options)


def test_an_administrator_may_give_the_flags_that_run_code_but_never_the_console_s_or_an_abbreviation():
    assert options_problem(["--trust-remote-code", "--allowed-local-media-path=/data"], administrator=True) is None
    assert "set by the console" in options_problem(["--host=0.0.0.0"], administrator=True)
    assert "write it in full" in options_problem(["--trust-remote"], administrator=True)
    # Kept from the deployment: an Operator's edit keeps what an Administrator decided, and adds nothing.
    assert options_problem(["--trust-remote-code", "--seed=1"], kept=["--trust-remote-code"]) is None
    assert "Administrator" in options_problem(["--trust-remote-code", "--config=/c"], kept=["--trust-remote-code"])


def test_a_copy_recorded_before_the_allowlist_still_starts_with_its_options():
    argv = vllm_command(gpu_indices=[0], options=["--some-old-flag=1"], **COMMON).argv
    assert argv[-1] == "--some-old-flag=1"
    with pytest.raises(ValueError, match="set by the console"):
        vllm_command(gpu_indices=[0], options=["--port=1"], **COMMON)


@pytest.mark.django_db(transaction=True)
def test_operator_is_refused_administrator_is_audited_and_an_edit_must_fix_old_options(cluster, model, fakes):  # noqa: F811
    operator, admin = UserFactory(role=roles.OPERATOR), UserFactory(role=roles.ADMINISTRATOR)
    with pytest.raises(ValidationError, match="Administrator's decision"):
        services.deployment_create(ask=ask(cluster, model, copies=1, engine_options=("--trust-remote-code",)), user=operator)
    assert not Deployment.objects.exists()

    deployment = services.deployment_create(
        ask=ask(cluster, model, copies=1, engine_options=("--trust-remote-code", "--seed=1")), user=admin)
    entry = AuditEntry.objects.get(action="deployment.engine_options")
    assert entry.user == admin and "--trust-remote-code" in entry.message and "--seed" not in entry.message

    # An Operator's change keeps the Administrator's flag and writes no new entry.
    services.deployment_change(deployment=deployment, ask=services.ask_of(
        deployment, engine_options=("--trust-remote-code", "--seed=2")), user=operator)
    assert AuditEntry.objects.filter(action="deployment.engine_options").count() == 1

    # Options recorded before the allowlist: the deployment keeps running; an edit must fix them.
    Deployment.objects.filter(pk=deployment.pk).update(engine_options=["--old-flag"])
    deployment.refresh_from_db()
    with pytest.raises(ValidationError, match="--old-flag is not an engine option"):
        services.deployment_change(deployment=deployment, ask=services.ask_of(deployment, context_length=2048), user=admin)
