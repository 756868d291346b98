"""``faden runtime-images``: the builds the server holds, what the machines need, importing builds.

The file name has a hyphen on purpose: Django finds commands by file name
(``pkgutil.iter_modules``) and imports them with ``importlib``, which takes any
name, so the command reads ``runtime-images`` like the design says.
"""
import argparse
import sys
from pathlib import Path

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from clusters import images
from clusters.models import RuntimeImage

USAGE = """\
  faden runtime-images                      list the builds the server holds
  faden runtime-images --check              the build each platform needs, held or MISSING (exit 1)
  faden runtime-images import FILE [FILE]   import runtime image files
"""


def mib(size: int) -> str:
    return f"{size / 1024 / 1024:.1f} MiB"


def table(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(row[column])) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


class Command(BaseCommand):
    help = "The runtime images the server holds, the build each platform needs, and importing builds.\n\n" + USAGE

    def add_arguments(self, parser):
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.add_argument("action", nargs="?", metavar="import", help="import FILE [FILE ...]")
        parser.add_argument("files", nargs="*", metavar="FILE", help="runtime image files to import")
        parser.add_argument("--check", action="store_true",
                            help="the build each platform and cluster needs, and whether the server holds it")

    def handle(self, *args, action=None, files=(), check=False, **options):
        if action not in (None, "import"):
            raise CommandError(f"Unknown action {action!r}: did you mean `import {action}`?", returncode=2)
        if action == "import":
            if check:
                raise CommandError("--check does not go with import.", returncode=2)
            if not files:
                raise CommandError("import needs at least one FILE.", returncode=2)
            self.import_files([Path(f) for f in files])
        elif check:
            self.report_needs()
        else:
            self.list_held()

    def import_files(self, paths: list[Path]) -> None:
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise CommandError(f"No such file: {', '.join(missing)}. Nothing was imported.", returncode=2)
        known = set(RuntimeImage.objects.values_list("pk", flat=True))
        for path in paths:
            try:
                image = images.runtime_image_import(path=path)
            except ValidationError as exc:
                raise CommandError(" ".join(exc.messages), returncode=2) from exc
            except OSError as exc:  # a full disk, a file we may not read: the system's own words
                raise CommandError(f"{path}: {exc.strerror or exc}.", returncode=1) from exc
            verb = "Already held" if image.pk in known else "Imported"
            self.stdout.write(
                f"{verb}: {image.name} {image.version}  {image.platform}  {image.digest[:12]}  {mib(image.size_bytes)}"
            )
            known.add(image.pk)

    def list_held(self) -> None:
        held = list(RuntimeImage.objects.all())
        if not held:
            self.stdout.write("The server holds no runtime builds. Import one with `faden runtime-images import FILE`.")
            return
        rows = [("NAME", "VERSION", "PLATFORM", "CERTIFIED", "SIZE", "DIGEST", "FILE")]
        for image in held:
            rows.append((image.name, image.version, image.platform, "yes" if image.certified else "no",
                         mib(image.size_bytes), image.digest[:12], "held" if images.runtime_image_held(image) else "MISSING"))
        self.stdout.write("\n".join(table(rows)))

    def report_needs(self) -> None:
        needs = images.runtime_images_needed()
        if not needs:
            self.stdout.write("No enrolled machine has accelerators: no runtime build is needed yet.")
            return
        rows = [("FOR", "PLATFORM", "MACHINES", "NEEDS", "STATUS")]
        for need in needs:
            wanted = (f"{need.image.name} {need.image.version} ({need.image.digest[:12]})" if need.image
                      else f"a certified {need.major}.x build (the server has none)")
            rows.append((need.scope, need.platform, len(need.machine_names), wanted, "held" if need.held else "MISSING"))
        self.stdout.write("\n".join(table(rows)))
        missing = [need for need in needs if not need.held]
        if not missing:
            self.stdout.write("The server holds every build the machines need.")
            return
        platforms = sorted({f"{need.platform} {need.major}.x" for need in missing})
        self.stdout.write(
            f"Missing for {', '.join(platforms)}: import the build with "
            "`faden runtime-images import FILE [FILE ...]`, then run `faden runtime-images --check` again."
        )
        self.stdout.flush()
        sys.exit(1)
