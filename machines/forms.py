"""The Add a machine form: the same model validation as the API, one step at a time."""
from django import forms
from django.core.exceptions import ValidationError

from console.forms import IntegerField
from machines import services
from machines.validators import validate_fingerprint


class MachineForm(forms.Form):
    name = forms.CharField(max_length=255, help_text="Lowercase letters, digits and hyphens, like gpu-01.")
    address = forms.CharField(max_length=255, help_text="The IP address or host name the console reaches it at.")
    ssh_port = IntegerField(label="SSH port", initial=22, min_value=1, max_value=65535)
    ssh_user = forms.CharField(label="SSH user", initial="root", max_length=255)

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        try:
            services.machine_validate(
                name=data["name"], address=data["address"], ssh_port=data["ssh_port"], ssh_user=data["ssh_user"]
            )
        except ValidationError as exc:
            for field, messages in exc.message_dict.items():
                for message in messages:
                    self.add_error(field if field in self.fields else None, message)
        return data

    def machine_fields(self) -> dict:
        return {k: self.cleaned_data[k] for k in ("name", "address", "ssh_port", "ssh_user")}


class ConfirmHostKeyForm(MachineForm):
    host_key_fingerprint = forms.CharField(widget=forms.HiddenInput, validators=[validate_fingerprint])


class TrustHostKeyForm(forms.Form):
    fingerprint = forms.CharField(validators=[validate_fingerprint])

