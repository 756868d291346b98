"""What a machine's name, address, SSH user, port and host key may look like.

Every refusal must say, in words a person understands, which rule was broken.
"""
import pytest
from django.core.exceptions import ValidationError
from hypothesis import given, settings
from hypothesis import strategies as st

from machines.validators import (
    validate_address,
    validate_fingerprint,
    validate_machine_name,
    validate_ssh_port,
    validate_ssh_user,
)

TEXT_FIELDS = {
    "name": validate_machine_name,
    "address": validate_address,
    "ssh_user": validate_ssh_user,
    "fingerprint": validate_fingerprint,
}

HOSTILE = {
    "a command after a semicolon": "a;rm -rf /",
    "a command substitution": "$(id)",
    "an ssh option": "-oProxyCommand=x",
    "backticks": "`id`",
    "a space": "gpu 01",
    "a newline": "gpu\n01",
    "a newline before a command": "gpu-01\nid",
}

# The words each field's refusal of a malformed value must contain.
FORMAT_WORDS = {
    "name": ["machine name", "lowercase letters, digits and hyphens"],
    "address": ["IP address", "host name"],
    "ssh_user": ["user name", "lowercase letter"],
    "fingerprint": ["fingerprint", "SHA256:", "43 characters"],
}

SHELL_METACHARACTERS = list(";&|$`<>()\\\"'*?[]{}!#~ \t\n\r")


def refusal(validator, value) -> str:
    with pytest.raises(ValidationError) as caught:
        validator(value)
    return " ".join(caught.value.messages)


@pytest.mark.parametrize("field", TEXT_FIELDS)
@pytest.mark.parametrize("value", HOSTILE.values(), ids=HOSTILE.keys())
def test_every_text_field_refuses_what_a_shell_or_ssh_would_read_as_more(field, value):
    message = refusal(TEXT_FIELDS[field], value)
    for words in FORMAT_WORDS[field]:
        assert words in message


@pytest.mark.parametrize(
    "field, words",
    [("name", "machine name"), ("address", "address"), ("ssh_user", "user name"), ("fingerprint", "host key fingerprint")],
)
def test_every_text_field_refuses_an_empty_value_by_asking_for_one(field, words):
    message = refusal(TEXT_FIELDS[field], "")
    assert message.startswith("Enter a")
    assert message.endswith(f" {words}.")


@pytest.mark.parametrize(
    "field, limit, words",
    [("name", 63, "machine name"), ("address", 253, "address"), ("ssh_user", 32, "user name"),
     ("fingerprint", 100, "host key fingerprint")],
)
def test_every_text_field_refuses_ten_kilobytes_saying_how_long_it_may_be(field, limit, words):
    message = refusal(TEXT_FIELDS[field], "a" * 10240)
    assert f"{words} is at most {limit} characters; this one has 10240." in message


@pytest.mark.parametrize("port", [0, 70000, -1, 65536, True, False, "22", 22.0, None])
def test_ssh_port_refuses_anything_but_a_number_from_1_to_65535(port):
    message = refusal(validate_ssh_port, port)
    assert "SSH port is a number from 1 to 65535" in message
    assert repr(port) in message


@pytest.mark.parametrize("port", [1, 22, 2222, 65535])
def test_ssh_port_accepts_ports_from_1_to_65535(port):
    validate_ssh_port(port)


@pytest.mark.parametrize(
    "address",
    ["198.18.0.11", "10.0.0.1", "fd00::11", "2001:db8::1", "::1", "gpu-01", "gpu-01.example.com", "GPU-01.Example.com.",
     "a" * 63 + ".example.com"],
)
def test_address_accepts_ipv4_ipv6_and_host_names(address):
    validate_address(address)


@pytest.mark.parametrize("address", ["999.1.1.1", "198.18.0", "gpu..example.com", "gpu-.example.com", "a" * 64 + ".com"])
def test_address_refuses_what_is_neither_an_ip_address_nor_a_host_name(address):
    assert "Enter an IP address" in refusal(validate_address, address)


@pytest.mark.parametrize("name", ["gpu-01", "a", "h100-node-7", "0", "a" * 63])
def test_machine_name_accepts_lowercase_dns_labels(name):
    validate_machine_name(name)


@pytest.mark.parametrize("name", ["GPU-01", "-gpu", "gpu-", "gpu_01", "gpu.01", "a" * 64])
def test_machine_name_refuses_what_is_not_a_lowercase_dns_label(name):
    refusal(validate_machine_name, name)


@pytest.mark.parametrize("user", ["root", "ubuntu", "_svc", "ops.team", "deploy-2", "a" * 32])
def test_ssh_user_accepts_ordinary_user_names(user):
    validate_ssh_user(user)


@pytest.mark.parametrize("user", ["Root", "1user", "-oUser", "a" * 33])
def test_ssh_user_refuses_names_a_system_would_not_give(user):
    refusal(validate_ssh_user, user)


def test_fingerprint_accepts_sha256_and_43_base64_characters():
    validate_fingerprint("SHA256:" + "A" * 43)
    validate_fingerprint("SHA256:abcdefghijklmnopqrstuvwxyz+/0123456789ABCDE")


@pytest.mark.parametrize(
    "value",
    ["SHA256:" + "A" * 42, "SHA256:" + "A" * 44, "sha256:" + "A" * 43, "MD5:" + "A" * 43, "SHA256:" + "A" * 42 + "=",
     "A" * 50],
)
def test_fingerprint_refuses_other_lengths_and_other_hashes(value):
    assert "SHA256: followed by 43 characters" in refusal(validate_fingerprint, value)


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(sorted(TEXT_FIELDS)),
    before=st.text(max_size=20),
    metacharacter=st.sampled_from(SHELL_METACHARACTERS),
    after=st.text(max_size=20),
)
def test_any_value_with_a_shell_metacharacter_is_refused(field, before, metacharacter, after):
    value = before + metacharacter + after
    with pytest.raises(ValidationError):
        TEXT_FIELDS[field](value)


@pytest.mark.parametrize(
    "field, value",
    [("name", "gpu-01\n"), ("address", "198.18.0.11\n"), ("address", "gpu-01\n"), ("ssh_user", "root\n"),
     ("fingerprint", "SHA256:" + "A" * 43 + "\n")],
)
def test_every_text_field_refuses_a_trailing_newline(field, value):
    refusal(TEXT_FIELDS[field], value)


@pytest.mark.parametrize("address", ["fe80::1%$(id)", "fe80::1%`id`", "fe80::1%a;id", "fe80::1% -oProxyCommand=x"])
def test_address_refuses_an_ipv6_scope_id_holding_shell_metacharacters(address):
    refusal(validate_address, address)


def test_address_refusals_use_the_right_article():
    assert refusal(validate_address, "") == "Enter an address."
    assert refusal(validate_address, "a" * 300).startswith("An address is at most 253 characters")
