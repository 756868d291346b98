"""The Settings page (Administrators only): the console's own settings, now the server's Hugging Face token.

The token's input is a password field that is never filled in again: the page says only whether a token
is set and where it comes from (hub_token.py). Its form's POST is marked sensitive, so Django's
error reports of a failed request show stars in place of the token.
"""
from django import forms
from django.contrib import messages
from django.shortcuts import redirect, render
from django.views.decorators.debug import sensitive_post_parameters, sensitive_variables
from django.views.decorators.http import require_POST

from deployments.store import hub_token


class HfTokenForm(forms.Form):
    token = forms.CharField(
        label="Token", strip=False, required=False,
        widget=forms.PasswordInput(render_value=False, attrs={
            "autocomplete": "off", "spellcheck": "false", "autocapitalize": "off", "placeholder": "hf_…"}),
        help_text="A read token from your Hugging Face account's Access Tokens page is enough.")

    @sensitive_variables()
    def clean_token(self) -> str:
        return hub_token.hf_token_clean(self.cleaned_data["token"])


def settings_page(request, form: HfTokenForm | None = None):
    """The settings and what each is now; the token only as Set or Not set."""
    hub_token.may_change_settings(request.user).check()
    context = {
        "form": form or HfTokenForm(), "hf_source": hub_token.hf_token_source(), "hf_saved": hub_token.hf_token_saved(),
        "hf_env": hub_token.ENV_VAR,
    }
    return render(request, "console/settings.html", context, status=400 if form is not None else 200)


@require_POST
@sensitive_post_parameters("token")
@sensitive_variables()
def hf_token_save(request):
    hub_token.may_change_settings(request.user).check()  # a role's refusal before any word about the token
    form = HfTokenForm(request.POST)
    if not form.is_valid():
        return settings_page(request, form)
    messages.success(request, hub_token.hf_token_set(token=form.cleaned_data["token"], by=request.user))
    return redirect("settings")


@require_POST
def hf_token_remove(request):
    messages.success(request, hub_token.hf_token_remove(by=request.user))
    return redirect("settings")
