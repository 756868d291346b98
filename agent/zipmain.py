"""The zipapp's ``__main__``: run the agent from a copy of its package unpacked beside the zip.

Python compiles every module it imports from a zip anew on each run (zipimport caches no bytecode),
and the agent imports all of its modules for every command: some 0.3 s of CPU per command, paid for
every SSH session and health check on every machine. Unpacked once into ``.unpacked/<zip name>-<digest>/``
next to the zip (the digest of the zip's bytes, so a replaced build is never run from an older copy),
the package's bytecode is cached in its ``__pycache__`` like any installed module's, and a command
starts in a few hundredths of a second. Where the directory cannot be written (a read-only home, a full
disk), the agent runs from the zip as before. The package is told which zip it came from
(``files.ZIP_PATH``): daemons and boot hooks are started from the zip, never from the unpacked copy.

Standard library only, like the rest of the agent; the server puts this file into the zip as its
``__main__.py`` and never imports it.
"""
import hashlib
import os
import sys

PACKAGE = "fadenstack_agent"


def _unpacked(zip_path):
    """The directory holding the zip's package unpacked (made now if it is missing), or None."""
    with open(zip_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    base = os.path.join(os.path.dirname(zip_path), ".unpacked")
    name = "%s-%s" % (os.path.basename(zip_path), digest)
    target = os.path.join(base, name)
    if os.path.isfile(os.path.join(target, PACKAGE, "__init__.py")):
        return target
    import shutil, tempfile, zipfile  # only to unpack: most commands find the copy there

    try:
        os.makedirs(base, mode=0o755, exist_ok=True)
        temp = tempfile.mkdtemp(prefix=".%s." % name, dir=base)
        with zipfile.ZipFile(zip_path) as archive:
            for member in archive.namelist():
                if member.startswith(PACKAGE + "/") and ".." not in member.split("/"):
                    archive.extract(member, temp)
        os.chmod(temp, 0o755)
        try:
            os.rename(temp, target)  # one step: another command unpacking at the same time keeps its own
        except OSError:
            shutil.rmtree(temp, ignore_errors=True)
        _forget_others(base, keep=name, zip_dir=os.path.dirname(zip_path))
    except OSError:
        return None
    return target if os.path.isdir(target) else None


def _forget_others(base, keep, zip_dir):
    """Copies of builds that are no longer installed go, and older copies of this one (it was replaced)."""
    import shutil

    mine = keep.rsplit("-", 1)[0]
    for entry in os.listdir(base):
        if entry == keep or entry.startswith("."):
            continue
        zip_name = entry.rsplit("-", 1)[0]
        if zip_name == mine or not os.path.exists(os.path.join(zip_dir, zip_name)):
            shutil.rmtree(os.path.join(base, entry), ignore_errors=True)


def run():
    zip_path = os.path.abspath(sys.path[0])  # as it was named: boot hooks name the current.pyz link
    unpacked = _unpacked(os.path.realpath(zip_path)) if os.path.isfile(zip_path) else None
    if unpacked:
        sys.path[0] = unpacked
        sys.dont_write_bytecode = False  # the copy is there for its bytecode (PYTHONDONTWRITEBYTECODE notwithstanding)
    from fadenstack_agent import files

    files.ZIP_PATH = zip_path if os.path.isfile(zip_path) else None
    from fadenstack_agent.__main__ import main

    sys.exit(main())


run()
