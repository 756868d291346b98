"""The life of a model in the server's store, and how each state looks."""
from django.db import models


class ModelState(models.TextChoices):
    DOWNLOADING = "downloading", "Downloading"  # its files come from the hub (or a directory) into the store
    READY = "ready", "Ready"  # every file is in the store and matched its digest
    FAILED = "failed", "Failed"  # the download stopped; Try again resumes it where it stopped


MODEL_BADGE = {
    ModelState.DOWNLOADING: "blue",
    ModelState.READY: "green",
    ModelState.FAILED: "red",
}

