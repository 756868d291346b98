"""The Connect card's certificate page: sign a short-lived SSH certificate for one of your keys (pasted, or
from your profile) for every node of a cluster or one, and show it in the answer to the POST, once.

Not a redirect to a page that shows it: the certificate would have to wait somewhere (the session) to
be shown there. The answer is never cached, and its message, which the audit trail keeps, names the
certificate's key id, never the certificate.
"""
from django import forms
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404, render

from clusters import connection_info
from clusters.models import Cluster
from console.roles import node_logins_allowed, role_of
from machines import ssh_rules
from machines.models import UserPublicKey

EVERY_NODE = ""


class CertificateForm(forms.Form):
    key = forms.ChoiceField(label="Your key", required=False)
    public_key = forms.CharField(label="Or paste a public key", required=False, strip=False,
                                 widget=forms.Textarea(attrs={"rows": 3, "placeholder": ssh_rules.EXAMPLE, "spellcheck": "false"}),
                                 help_text="The one line of your .pub file (cat ~/.ssh/id_ed25519.pub).")
    node = forms.ChoiceField(label="For", required=False)

    def __init__(self, *args, keys=(), nodes=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["key"].choices = [("", "Paste one below")] + [(k.name, f"{k.name} · {k.fingerprint}") for k in keys]
        self.fields["node"].choices = [(EVERY_NODE, "Every node")] + [(n.name, f"{n.name} ({n.machine})") for n in nodes]
        if keys and not self.is_bound:
            self.initial["key"] = keys[0].name


def cluster_ssh_certificate(request, pk: int):
    """GET: the form (your keys, a paste area, which nodes). POST: sign, and show the certificate once."""
    cluster = get_object_or_404(Cluster, pk=pk)
    offer = ssh_rules.node_login_offer(role=role_of(request.user), allowed=node_logins_allowed(request.user))
    keys = list(UserPublicKey.objects.filter(user=request.user))
    try:
        reach, waiting = connection_info.connection_of(cluster), ""
    except connection_info.NotConnectable as why:
        reach, waiting = None, str(why)
    form = CertificateForm(request.POST or None, keys=keys, nodes=reach.nodes if reach else ())
    context = {"cluster": cluster, "offer": offer, "waiting": waiting, "form": form, "keys": keys, "login": None,
               "valid_for": connection_info.validity_words()}
    if request.method != "POST":
        return render(request, "clusters/ssh_certificate.html", context)
    form.is_valid()  # every choice is optional: the service says what is wrong, in the rules' words
    asked = form.cleaned_data
    try:
        login = connection_info.node_login_certificate(user=request.user, cluster=cluster, public_key=asked.get("public_key", ""),
                                               key_name=asked.get("key", ""), node=asked.get("node") or None)
    except ValidationError as refused:
        said = refused.message_dict if hasattr(refused, "error_dict") else {None: refused.messages}
        for field, texts in said.items():
            for text in texts:
                form.add_error(field if field in form.fields else None, text)
        messages.error(request, " ".join(text for texts in said.values() for text in texts))
        return render(request, "clusters/ssh_certificate.html", context, status=400)
    issued = login.issued
    one = login.nodes[0] if asked.get("node") else None
    messages.success(request, f"Signed the certificate {issued.key_id} for {f'node {one.name}' if one else 'every node'} "
                              f"of {cluster.name}: copy it now, it is shown only this once.")
    commands = login.reach.snippets.ssh_commands
    context |= {"login": login, "commands": [(n, commands[n.name]) for n in login.nodes]}
    response = render(request, "clusters/ssh_certificate.html", context, status=201)
    response["Cache-Control"] = "no-store"
    return response
