"""The console's forms: the Users page's (add a user, change a role; the rules themselves are the
services'), and the form fields every app's forms share (numbers read as ``console.params`` reads them)."""
from django import forms
from django.core.exceptions import ValidationError

from console import params
from console.roles import ROLES, VIEWER, Role, role_named

ROLE_CHOICES = [(role.name, role.name) for role in ROLES]


class IntegerField(forms.IntegerField):
    """Django's IntegerField, reading numbers as ``console.params`` does: the digits 0-9 only (Django's
    own reads "٢٢" as 22), refused in the same words."""

    def to_python(self, value):
        if value in self.empty_values:
            return None
        low = 0 if self.min_value is None else self.min_value
        high = params.ID_MAX if self.max_value is None else self.max_value
        try:
            return params.parse_int(value, name=self.label or "number", low=low, high=high)
        except params.InvalidParameter as exc:
            raise ValidationError(exc.message, code="invalid") from None


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=ROLE_CHOICES, initial=VIEWER.name)

    def chosen_role(self) -> Role:
        return role_named(self.cleaned_data["role"])


class UserAddForm(RoleForm):
    username = forms.CharField(label="User name", max_length=150)
    email = forms.EmailField(label="Email", required=False)
    password = forms.CharField(widget=forms.PasswordInput(render_value=False), strip=False,
                               help_text="At least 8 characters, not a common one. Give it to them; they sign in with it.")
    role = forms.ChoiceField(choices=ROLE_CHOICES, initial=VIEWER.name,
                             help_text="Viewer reads everything; Operator also runs clusters; Administrator also enrols machines and manages users.")

    field_order = ["username", "email", "password", "role"]
