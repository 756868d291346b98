"""``faden models``: the models in the server's store, and importing one from a directory.

``faden models import PATH --repo NAME [--revision REV]`` takes a model on a server without internet:
a directory holding a snapshot of the repository (config.json, the tokenizer's files, safetensors
weights). The same checks as a download (room in the store, well-formed config and weights), then
every file is hashed into the store and the model is Ready, with its facts read from its files.
"""
import argparse
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from deployments.models import StoredModel
from deployments.store import disk, downloads, hub

USAGE = """\
  faden models                                       list the models in the server's store
  faden models import PATH --repo NAME [--revision REV]  import a model from a directory on the server
"""


class Command(BaseCommand):
    help = "The models in the server's store, and importing one from a directory.\n\n" + USAGE

    def add_arguments(self, parser):
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.add_argument("action", nargs="?", metavar="import", help="import PATH")
        parser.add_argument("path", nargs="?", metavar="PATH", help="the model's directory")
        parser.add_argument("--repo", help="the repository id it is known by: org/name")
        parser.add_argument("--revision", default="main", help="the revision it is known by (default main)")

    def handle(self, *args, action=None, path=None, repo=None, revision="main", **options):
        if action is None:
            return self.list_models()
        if action != "import":
            raise CommandError(f"Unknown action {action!r}: use `faden models import PATH --repo NAME`.", returncode=2)
        if not path or not repo:
            raise CommandError("import needs PATH and --repo NAME.", returncode=2)
        for problem in (hub.repo_problem(repo), hub.revision_problem(revision)):
            if problem:
                raise CommandError(problem, returncode=2)
        directory = Path(path)
        if not directory.is_dir():
            raise CommandError(f"{directory} is not a directory. Nothing was imported.", returncode=2)
        try:
            model = downloads.model_import(directory=directory, repo=repo, revision=revision)
        except ValueError as exc:
            raise CommandError(f"{exc} Nothing was imported.", returncode=2) from exc
        except OSError as exc:
            raise CommandError(f"{exc.filename or directory}: {exc.strerror or exc}. Nothing was imported.", returncode=1) from exc
        facts = model.facts
        self.stdout.write(f"Imported {model}: {disk.gb(model.bytes_total)} in {model.files.count()} files, "
                          f"{facts.get('architecture') or 'unknown architecture'}, {facts.get('dtype')}, "
                          f"needs {disk.gb(facts.get('gpu_memory_bytes') or 0)} of GPU memory a copy.")

    def list_models(self) -> None:
        models = list(StoredModel.objects.all())
        if not models:
            self.stdout.write("The store holds no models. Add one on the Models page, or `faden models import PATH --repo NAME`.")
            return
        rows = [("MODEL", "REVISION", "STATE", "SIZE", "COMMIT")]
        rows += [(m.repo, m.revision, m.get_state_display(), disk.gb(m.bytes_total), m.commit[:12]) for m in models]
        widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
        for row in rows:
            self.stdout.write("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
