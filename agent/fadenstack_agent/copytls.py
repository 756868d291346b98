"""A copy behind mutual TLS (``copy start`` with ``--ssl-*`` flags): its files are the cluster's own
(``tls request|install``, tlsfiles.py), and the machine asks its own copy with the copy certificate as
its client's, trusting only the console's authority."""

import json
import os
import re
import ssl

from .protocol import BAD_INPUT, AgentError
from .tlsfiles import CA, IN_CONTAINER, TLS, tls_dir

TLS_FLAGS = ("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs")
TLS_IN_CONTAINER = IN_CONTAINER + "/" + TLS + "/"


def tls_argv(argv: list, cluster: str, in_container: bool) -> list:
    """The argv with its TLS files where the engine finds them: each ``--ssl-*`` file must be one of the
    cluster's (``/etc/fadenstack/cluster/tls/NAME``, ``bad_input`` otherwise); without a container
    (``process``) it becomes this machine's path of the same file."""
    argv = list(argv)
    for i, word in enumerate(argv[:-1]):
        if word in TLS_FLAGS:
            path = argv[i + 1]
            name = path[len(TLS_IN_CONTAINER):] if path.startswith(TLS_IN_CONTAINER) else ""
            if not re.match(r"^[a-z]+\.(pem|key)$", name):
                raise AgentError(BAD_INPUT, "%s must name one of the cluster's TLS files (%sNAME), got %s"
                                 % (word, TLS_IN_CONTAINER, json.dumps(path)[:120]))
            if not in_container:
                argv[i + 1] = os.path.join(tls_dir(cluster), name)
    return argv


def uses_tls(record: dict) -> bool:
    return "--ssl-certfile" in (record.get("argv") or [])


def client_context(cluster: str):
    """How this machine asks its own copy behind mutual TLS: the machine's copy certificate as the
    client's (the authority signs it for both), and only the console's authority trusted."""
    directory = tls_dir(cluster)
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=os.path.join(directory, CA))
    context.load_cert_chain(os.path.join(directory, "copy.pem"), os.path.join(directory, "copy.key"))
    return context
