"""A copy behind mutual TLS, on the ``process`` driver without a lab: the real agent starts the lab's engine with
the console's ``--ssl-*`` flags (the cluster's files as the container sees them, here this machine's), ``copy
list`` reads it healthy over mutual TLS with the machine's copy certificate, and a client without a certificate
of the authority's is refused. A throwaway authority made here with ``cryptography`` stands for the console's."""
import datetime
import http.client
import ipaddress
import json
import os
import ssl

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fadenstack_agent import copies
from fadenstack_agent.protocol import AgentError
from tests.agent.test_copies import agent, argv_for, free_port, machine, tiny_model  # noqa: F401 (fixtures)

TLS_FLAGS = ["--ssl-keyfile", "/etc/fadenstack/cluster/tls/copy.key", "--ssl-certfile",
             "/etc/fadenstack/cluster/tls/copy.pem", "--ssl-ca-certs", "/etc/fadenstack/cluster/tls/ca.pem",
             "--ssl-cert-reqs", "2", "--enable-ssl-refresh"]


def _name(text):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


def _pem(thing) -> bytes:
    return thing.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _signed(ca_key, ca_name, key, name, *, usages, address=None, ca=False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if address:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]),
                                        critical=False)
    return builder.sign(ca_key, hashes.SHA256())


@pytest.fixture
def authority(machine, tmp_path):
    """The cluster's TLS files on the machine (a copy certificate for 127.0.0.1, server and client), and a
    client certificate of the same authority, as the gateway holds."""
    machine.env["FADEN_AGENT_SECRETS"] = str(tmp_path / "secrets")
    directory = tmp_path / "secrets" / "gpu-room" / "tls"
    directory.mkdir(parents=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("throwaway CA")
    ca = _signed(ca_key, ca_name, ca_key, "throwaway CA", usages=None, ca=True)
    copy_key = ec.generate_private_key(ec.SECP256R1())
    copy = _signed(ca_key, ca_name, copy_key, "copy 127.0.0.1", address="127.0.0.1",
                   usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    (directory / "ca.pem").write_bytes(_pem(ca))
    (directory / "copy.pem").write_bytes(_pem(copy))
    (directory / "copy.key").write_bytes(_key_pem(copy_key))
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _signed(ca_key, ca_name, client_key, "client", usages=[ExtendedKeyUsageOID.CLIENT_AUTH])
    (tmp_path / "client.pem").write_bytes(_pem(client))
    (tmp_path / "client.key").write_bytes(_key_pem(client_key))

    def renew() -> bytes:
        again = _signed(ca_key, ca_name, copy_key, "copy 127.0.0.1", address="127.0.0.1",
                        usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
        (directory / "copy.pem.new").write_bytes(_pem(again))
        os.replace(directory / "copy.pem.new", directory / "copy.pem")
        return again.public_bytes(serialization.Encoding.DER)

    return {"dir": directory, "client": (str(tmp_path / "client.pem"), str(tmp_path / "client.key")), "renew": renew}


def _get(port, context):
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=context)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_copy_behind_mutual_tls_answers_only_a_client_certificate_of_the_authority(machine, tiny_model, authority):
    port = free_port()
    spec = {"copy": "d7-c3", "cluster": "gpu-room", "argv": argv_for(tiny_model, port, *TLS_FLAGS),
            "env": {"CUDA_VISIBLE_DEVICES": "0"}, "port": port, "address": "127.0.0.1"}
    code, started = agent(machine, "copy", "start", stdin=spec)
    assert code == 0, started
    # Without a container, the engine reads the cluster's files where they are on this machine.
    key_path = started["argv"][started["argv"].index("--ssl-keyfile") + 1]
    assert key_path == str(authority["dir"] / "copy.key")
    code, listed = agent(machine, "copy", "list")
    assert listed["copies"][0]["healthy"] is True, listed  # asked over mutual TLS, with the machine's certificate

    trusting = ssl.create_default_context(cafile=str(authority["dir"] / "ca.pem"))
    client = ssl.create_default_context(cafile=str(authority["dir"] / "ca.pem"))
    client.load_cert_chain(*authority["client"])
    assert _get(port, client) == 200
    with pytest.raises((ssl.SSLError, ConnectionError)):  # no client certificate: refused in the handshake
        _get(port, trusting)
    plain = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    with pytest.raises((http.client.HTTPException, ConnectionError)):  # plain HTTP gets nothing either
        plain.request("GET", "/health")
        plain.getresponse()
    plain.close()
    assert _get(port, client) == 200  # the refusals held nothing up
    # A renewed certificate (tls install) reaches new connections without a restart (--enable-ssl-refresh).
    renewed = authority["renew"]()
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=client)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    assert conn.sock.getpeercert(binary_form=True) == renewed
    conn.close()
    code, _ = agent(machine, "copy", "stop", "--copy", "d7-c3")
    assert code == 0


def test_tls_files_must_be_the_cluster_s_own():
    argv = ["vllm", "serve", "/m", "--ssl-keyfile", "/root/.ssh/id_ed25519"]
    with pytest.raises(AgentError, match="must name one of the cluster's TLS files"):
        copies.tls_argv(argv, "gpu-room", in_container=True)
    good = ["vllm", "serve", "/m"] + TLS_FLAGS
    assert copies.tls_argv(good, "gpu-room", in_container=True) == good
    assert json.dumps(copies.tls_argv(good, "gpu-room", in_container=False)).count("/etc/fadenstack/cluster/") == 0
    assert os.path.basename(copies.tls_argv(good, "gpu-room", in_container=False)[4]) == "copy.key"
