"""Units as administrators read them."""
from django import template
from django.template.defaultfilters import filesizeformat

register = template.Library()


@register.filter
def filesizeformat_mib(mib) -> str:
    return filesizeformat(int(mib) * 1024 * 1024) if mib not in (None, "") else "—"


@register.filter
def speed(mbps) -> str:
    if mbps in (None, ""):
        return "—"
    mbps = int(mbps)
    return f"{mbps / 1000:g} Gbit/s" if mbps >= 1000 else f"{mbps} Mbit/s"
