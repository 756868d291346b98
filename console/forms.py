"""The Users page's forms: add a user, change a role. The rules themselves are the services'."""
from django import forms

from console.roles import ROLES, VIEWER, Role, role_named

ROLE_CHOICES = [(role.name, role.name) for role in ROLES]


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
