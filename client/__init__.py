"""The console's client: ``faden ssh``, ``faden clusters tunnel`` and ``faden clusters test``, for any
computer that has the console's URL and an API token.

It speaks to the console through the REST API only (``FADEN_URL`` and ``FADEN_TOKEN``, or ``--url`` and
``--token``), never through the database or the settings, and imports nothing of the server's and no
Django (an import-linter contract in pyproject.toml holds it): ``config/cli.py`` hands it these commands
before Django is set up, so it runs where the console's data directory does not exist.

``api.py`` is the REST API as one token sees it, ``ssh.py`` the user's key, the certificate and
``faden ssh``, ``tunnel.py`` and ``nccl_test.py`` the two cluster commands, ``cli.py`` the command line.

    faden ssh [-i KEY] CLUSTER [NODE] [-- COMMAND...]

finds the cluster by name, reads the public key beside ``KEY`` (``~/.ssh/id_ed25519`` by default),
asks ``POST /api/clusters/<id>/ssh-certificates/`` for a certificate for that one node (node-0, the
head, when none is named), writes it into a directory private to the user, and runs OpenSSH's ``ssh``
in this process's place with ``-i KEY -o CertificateFile=...`` and the node's address, as an argv (no
shell line is built). The certificate is printed nowhere; its key id is.

    faden clusters tunnel [-i KEY] [--local-port 8265] [--client-port 10001] CLUSTER

signs the same certificate for node-0 (the head) and runs ``ssh -N -L 127.0.0.1:8265:127.0.0.1:8265
-L 127.0.0.1:10001:127.0.0.1:10001`` as a child until Ctrl-C: Ray's dashboard and job API and Ray
Client, which listen on the head's loopback only. The certificate file is removed when it ends.

    faden clusters test [--yes] CLUSTER

starts the NCCL test (``POST /api/clusters/<id>/tests/``), asks once to confirm when the console says
copies are serving, then asks for the test every second and prints each message size as it finishes,
then the peak and the console's sentence; exit status 1 when the test failed.
"""
