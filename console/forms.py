"""Form fields the apps' forms share."""
from django import forms
from django.core.exceptions import ValidationError

from console import params


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
