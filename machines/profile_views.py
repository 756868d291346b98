"""Your profile's SSH keys (/profile/keys/): the list, Add a key, Remove. The console signs node-login
certificates for these keys by name (the cluster page's Get an SSH certificate, and the API's ``key``).
Each person sees and changes only their own."""
from django import forms
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from console.roles import node_logins_allowed, role_of
from machines import ssh_rules, user_keys


class KeyForm(forms.Form):
    name = forms.CharField(max_length=100, label="Name", widget=forms.TextInput(attrs={"placeholder": "laptop"}),
                           help_text="What you call this key.")
    key = forms.CharField(max_length=20000, label="Public key", strip=False,
                          widget=forms.Textarea(attrs={"rows": 3, "placeholder": ssh_rules.EXAMPLE, "spellcheck": "false"}),
                          help_text="The one line of your .pub file (cat ~/.ssh/id_ed25519.pub): ssh-ed25519, "
                                    "ecdsa-sha2-nistp256/384/521, or ssh-rsa of at least 3072 bits.")


def profile_keys(request, form: KeyForm | None = None):
    """Your keys by name, and the form to add one."""
    node_login = ssh_rules.node_login_offer(role=role_of(request.user), allowed=node_logins_allowed(request.user))
    context = {"keys": user_keys.user_public_keys(request.user), "form": form or KeyForm(), "node_login": node_login}
    return render(request, "machines/profile_keys.html", context, status=400 if form is not None else 200)


@require_POST
def profile_key_add(request):
    form = KeyForm(request.POST)
    if not form.is_valid():
        return profile_keys(request, form)
    try:
        row = user_keys.user_public_key_add(user=request.user, **form.cleaned_data)
    except ValidationError as refused:
        for field, texts in (refused.message_dict if hasattr(refused, "error_dict") else {None: refused.messages}).items():
            for text in texts:
                form.add_error(field if field in form.fields else None, text)
        return profile_keys(request, form)
    messages.success(request, f"Added the key {row.name} ({row.fingerprint}).")
    return redirect("profile-keys")


@require_POST
def profile_key_remove(request, pk: int):
    row = user_keys.user_public_key_remove(user=request.user, key_id=pk)
    messages.success(request, f"Removed the key {row.name} ({row.fingerprint}). Certificates signed for it stay valid until they expire.")
    return redirect("profile-keys")
