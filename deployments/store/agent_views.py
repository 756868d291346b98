"""What the machines' agents fetch from the console for models: the first copy of a model's file."""
from __future__ import annotations

from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_http_methods

from clusters.agent_views import file_response, open_whole
from console.agent_tls import agents_over_tls
from deployments.models import ModelFile
from deployments.store import disk, machine_files


@login_not_required
@require_http_methods(["GET", "HEAD"])
@agents_over_tls
def model_file_download(request: HttpRequest, digest: str):
    """A model's file for a machine, with ``Range``: ``Authorization: Bearer <model file token>``."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    refusal = machine_files.file_download_refusal(token.strip() if scheme == "Bearer" else "", digest=digest)
    if refusal:
        return JsonResponse({"error": refusal}, status=401)
    row = ModelFile.objects.filter(sha256=digest).first()
    fd = open_whole(disk.blob_path(digest), row.size) if row else None
    if fd is None:
        return JsonResponse({"error": f"The server does not hold the model file {digest[:12]} any more."}, status=404)
    return file_response(request, fd, size=row.size, digest=digest, what="the file")
