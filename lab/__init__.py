"""The Fadenstack lab: virtual GPU machines on one Linux host.

Each machine is a network namespace (plus its own mount and UTS namespaces)
running OpenSSH's sshd, with stub ``nvidia-smi`` / ``rocm-smi`` / ``uname``
that answer from the machine's spec. Networks are Linux bridges joined by
veth pairs and shaped with ``tc``. Used by the test suite, the demo and the
benchmarks (ARCHITECTURE.md section 6).

Standard library only; imports nothing from the server. Entry point:
``lab.cli.main(argv)`` (also ``python -m lab``).
"""

DEFAULT_STATE_DIR = "/var/tmp/fadenstack-lab"
