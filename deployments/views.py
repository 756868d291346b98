"""The deployments list: every model deployment and the cluster it runs on."""
from django.shortcuts import render

from deployments.models import Deployment


def deployment_list(request):
    deployments = Deployment.objects.select_related("cluster")
    return render(request, "deployments/deployment_list.html", {"deployments": deployments})
