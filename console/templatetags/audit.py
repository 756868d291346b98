"""``{% load audit %}``: whether the signed-in user may read the audit trail (the side bar's link)."""
from django import template

from console import audit

register = template.Library()


@register.filter
def may_read_audit(user) -> bool:
    return audit.may_read(user)
