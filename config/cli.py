"""``faden``: every management command, plus ``faden lab ...`` for the virtual machine lab and the client
commands (``faden ssh``: the client package), which speak to a console over its API from any computer."""
import os
import sys
from typing import NoReturn

import client.cli


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] and argv[0] in client.cli.COMMANDS:
        # Before Django: the client needs no settings, no data directory and no database.
        return client.cli.main(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    if argv[:1] == ["lab"]:
        return lab(argv[1:])
    from django.core.management import execute_from_command_line

    execute_from_command_line(["faden", *argv])
    return 0


def lab(argv: list[str]) -> NoReturn:
    """Run the lab, handing it the console's public key so its machines accept the console.

    The lab runs as ``python -m lab`` in place of this process (exec, not a child): the server
    imports none of the lab's code, and the lab keeps the terminal, the signals and the exit status.
    """
    if argv[:1] == ["up"] and "--authorized-key" not in argv:
        import django

        django.setup()
        from machines.remote import console_key_path, console_public_key

        console_public_key()  # made on first use
        argv = [*argv, "--authorized-key", str(console_key_path().with_suffix(".pub"))]
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "lab", *argv])


if __name__ == "__main__":
    sys.exit(main())
