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


@register.filter
def time_left(transfer) -> str:
    """How long the rest of a file takes at the current rate: ``42 s``, ``3 min``."""
    remaining = transfer.bytes_total - transfer.bytes_done
    if not transfer.rate or remaining <= 0:
        return "—"
    seconds = remaining / transfer.rate
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


@register.filter
def machines_count(count) -> str:
    """"both machines" for two, "all 5 machines" for more: the networks' sentences of the wizard and the network page."""
    return "both machines" if count == 2 else f"all {count} machines"


@register.filter
def parameters(count) -> str:
    """A model's parameter count as model cards write it: 1.2 B, 64.1 M, 950 K."""
    if not count:
        return "—"
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return str(count)


@register.filter
def share(part) -> str:
    """A share of one GPU as people say it: "a quarter", "half", "three quarters"."""
    from fractions import Fraction

    part = Fraction(part)
    return {Fraction(1, 4): "a quarter", Fraction(1, 2): "half", Fraction(3, 4): "three quarters"}.get(part, f"{float(part):g}")


@register.filter
def gpus(count) -> str:
    """GPUs as a figure: 12, 11.75."""
    value = float(count)
    return f"{int(value)}" if value == int(value) else f"{value:.2f}".rstrip("0")


@register.filter
def milliseconds(value) -> str:
    """A latency as people read it: ``0.8 ms``, ``42 ms``, ``1.3 s``; ``—`` when there is none."""
    if value in (None, ""):
        return "—"
    value = float(value)
    if value < 10:
        return f"{value:.1f} ms"
    if value < 1000:
        return f"{value:.0f} ms"
    return f"{value / 1000:.1f} s"


@register.filter
def per_minute(value) -> str:
    """A rate per minute: ``0.4``, ``12``, ``1.2 k``."""
    value = float(value or 0)
    if value >= 1000:
        return f"{value / 1000:.1f} k"
    return f"{value:.1f}".rstrip("0").rstrip(".") if value < 10 else f"{value:.0f}"


@register.filter
def step_seconds(value) -> str:
    """How long a job's step ran: ``0.8 s``, ``12 s``, ``2 min 5 s``, ``1 h 4 min``."""
    seconds = float(value or 0)
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


@register.filter
def compact(count) -> str:
    """A large count in a few digits, for tables: 17.6 M, 909.1 K, 9,500 (in full below 10,000)."""
    count = count or 0
    if count >= 10_000:
        for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
            if count >= size:
                return f"{count / size:.1f} {unit}"
    return f"{count:,}"
