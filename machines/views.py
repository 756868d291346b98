"""Machine pages: the list, Add a machine (details, then the host key), a machine's page.

Each renders for the user's role (machines/actions.py): a button the role may not press is greyed
out with the reason, and a service that refuses for the role answers 403 with it.
"""
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db.models import Count, Prefetch
from django.shortcuts import get_object_or_404, redirect, render
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST
from django_htmx.http import HttpResponseClientRedirect

from console import params, roles
from console.models import Job
from machines import actions, remote, runtimes, services
from machines.agent import agent_version
from machines.cards import machine_cards_extra
from machines.choices import AGENT_PENDING, MachineState, RuntimeChoice
from machines.forms import ConfirmHostKeyForm, MachineForm, TrustHostKeyForm
from machines.models import Accelerator, Machine, MachineEvent
from machines.versions import agent_outdated

PAGE_SIZE = 50


def machine_list_queryset():
    """Machines with what every list shows, in a fixed number of queries whatever their number.

    Lists show none of the JSON the agents and health checks report, which is most of each row's bytes.
    """
    # "drain": a drain's row (deployments' Drain, by its relation's name only), whose state the rows show.
    return (Machine.objects.select_related("membership__cluster", "drain")
            # By index alone: the default order (machine, index) would join every machine again to sort by name.
            .prefetch_related(Prefetch("accelerators", queryset=Accelerator.objects.order_by("index")))
            .defer("facts", "membership__last_status", "membership__cluster__last_status"))


def machine_summary() -> dict:
    by_state = dict(Machine.objects.values_list("state").annotate(n=Count("id")).order_by())
    return {
        "total": sum(by_state.values()),
        "healthy": by_state.get(MachineState.HEALTHY, 0),
        "attention": sum(by_state.get(s, 0) for s in (MachineState.OFFLINE, MachineState.FAILED, MachineState.HOST_KEY)),
        "accelerators": Accelerator.objects.count(),
    }


def recent_events(request) -> dict:
    """The dashboard's panel of what last happened to any machine."""
    return {"events": MachineEvent.objects.select_related("machine").defer("machine__facts")[:12]}


def agent_outdated_versions() -> dict[str, int]:
    """The agent versions older than the console's that machines with an agent report, and how many
    report each: one query grouped by version (versions order by their numbers, which SQL cannot)."""
    reported = (Machine.objects.exclude(state__in=AGENT_PENDING).values_list("agent_version")
                .annotate(n=Count("id")).order_by())
    latest = agent_version()
    return {version: n for version, n in reported if agent_outdated(version, latest)}


def _filtered(request, outdated: dict[str, int]):
    machines = machine_list_queryset()
    state = request.GET.get("state", "")
    if state in MachineState.values:
        machines = machines.filter(state=state)
    if query := params.text_param(request.GET, "q"):
        machines = machines.filter(name__icontains=query) | machines.filter(address__icontains=query)
    agent = params.choice_param(request.GET, "agent", ["outdated"])
    if agent:
        machines = machines.exclude(state__in=AGENT_PENDING).filter(agent_version__in=list(outdated))
    return machines, state, query, agent


def machine_list(request):
    outdated = agent_outdated_versions()
    machines, state, query, agent = _filtered(request, outdated)
    page = Paginator(machines, PAGE_SIZE).get_page(params.int_param(request.GET, "page", default=1))
    return render(
        request,
        "machines/machine_list.html",
        {
            "page": page,
            "machines": page.object_list,
            "summary": machine_summary(),
            "states": MachineState.choices,
            "state": state,
            "query": query,
            "agent": agent,
            "agent_outdated_count": sum(outdated.values()),
            "live_topics": "topic=machines",
            "add": actions.ADD.offer(roles.role_of(request.user)),
            "update_agent": actions.UPDATE_AGENT.offer(roles.role_of(request.user)),
            "agent_latest": agent_version(),
        },
    )


def machine_add(request):
    """Step one: name, address, port, user. Step two: confirm the host key the machine offered.

    A role that may not add machines sees the form greyed out, with the reason; its POST is refused
    before the console reaches out to the address."""
    add = actions.ADD.offer(roles.role_of(request.user))
    if request.method == "POST":
        add.check()
    context = {"public_key": remote.console_public_key(), "add": add}
    if request.method == "POST" and request.POST.get("step") == "confirm":
        form = ConfirmHostKeyForm(request.POST)
        if form.is_valid():
            try:
                machine = services.machine_create(
                    **form.machine_fields(), host_key_fingerprint=form.cleaned_data["host_key_fingerprint"], user=request.user
                )
            except ValidationError as exc:
                # The confirm step shows no fields: every refusal is shown at the top.
                for message in exc.messages:
                    form.add_error(None, message)
            else:
                messages.success(request, f"{machine.name} is being enrolled.")
                url = machine.get_absolute_url()
                return HttpResponseClientRedirect(url) if request.htmx else redirect(url)
        context.update(form=form, step="confirm", fingerprint=request.POST.get("host_key_fingerprint", ""))
    elif request.method == "POST":
        form = MachineForm(request.POST)
        step = "details"
        if form.is_valid():
            fields = form.machine_fields()
            try:
                fingerprint = services.machine_host_key_scan(address=fields["address"], ssh_port=fields["ssh_port"])
            except ValidationError as exc:
                form.add_error(None, exc)
            else:
                form = ConfirmHostKeyForm(initial={**fields, "host_key_fingerprint": fingerprint})
                context["fingerprint"] = fingerprint
                step = "confirm"
        context.update(form=form, step=step)
    else:
        context.update(form=MachineForm(), step="details")
    if request.htmx:
        return render(request, "machines/machine_add.html#add-form", context)
    return render(request, "machines/machine_add.html", context)


def runtime_options(machine: Machine) -> dict:
    """The runtime card's radio buttons: automatic, then each engine, the ones not found greyed out."""
    found = {r.name: r for r in machine.runtimes_found()}
    choices = [{"value": RuntimeChoice.AUTOMATIC, "label": "Automatic", "found": True, "version": "",
                "help": "Docker when found, else Podman."}]
    for engine in runtimes.ENGINES:
        runtime = found.get(engine)
        choices.append({"value": engine, "label": runtimes.label(engine), "found": runtime is not None,
                        "version": runtime.version if runtime else "",
                        "help": f"Found on {machine.name}." if runtime else f"Not found on {machine.name}."})
    return {"found": list(found.values()), "choices": choices}


def machine_cards(machine: Machine, *, role: roles.Role | None) -> dict:
    """Everything a machine's page shows, for ``role``; the page, htmx and the websocket render from this."""
    jobs = list(Job.objects.filter(target_type="machine", target_id=machine.pk)[:5])
    busy = bool(jobs) and jobs[0].is_active
    accelerators = list(machine.accelerators.all())
    return {
        "machine": machine,
        "role": role,
        "actions": actions.machine_actions(machine, busy=busy, role=role),
        "runtime_options": runtime_options(machine),
        "accelerators": accelerators,
        "foreign_gpus": [a for a in accelerators if a.foreign_pids],  # a person's job on them: each said in a line
        "interfaces": list(machine.interfaces.all()),
        "job": jobs[0] if jobs else None,
        "jobs": jobs,
        "events": list(machine.events.all()[:15]),
    } | machine_cards_extra(machine, role)


def machine_detail(request, pk: int):
    machine = get_object_or_404(Machine, pk=pk)
    context = machine_cards(machine, role=roles.role_of(request.user)) | {"live_topics": f"topic=machine:{machine.pk}"}
    return render(request, "machines/machine_detail.html", context)


@require_POST
def machine_refresh(request, pk: int):
    machine = get_object_or_404(Machine, pk=pk)
    try:
        services.machine_refresh(machine=machine, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    return redirect(machine)


@require_POST
def machine_update_agent(request, pk: int):
    machine = get_object_or_404(Machine, pk=pk)
    try:
        services.machine_update_agent(machine=machine, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, f"Updating the agent on {machine.name} to {agent_version()}; Ray and the runtime keep running.")
    return redirect(machine)


@require_POST
def machines_update_agent(request):
    """The list's selection: Update agent on every machine ticked whose agent is out of date."""
    ids = params.id_list(request.POST.getlist("machines"), name="machines")
    try:
        updates = services.machines_update_agent(machine_ids=ids, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        _say_agent_updates(request, updates)
    back = request.POST.get("next", "")
    if not (back.startswith(reverse("machines:list")) and url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()})):
        back = reverse("machines:list")
    return redirect(back)


def _names(machines: list[Machine], limit: int = 8) -> str:
    """``lab-a, lab-b and lab-c``; past ``limit``, ``lab-a, …, lab-h and 4 more``."""
    names = [m.name for m in machines]
    if len(names) > limit:
        names = [*names[:limit], f"{len(machines) - limit} more"]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _say_agent_updates(request, updates: services.AgentUpdates) -> None:
    """One line for what started, one for what was up to date, one per refusal. With something started,
    the refusals are told as information: the request did what it could (the audit trail reads Done)."""
    latest = agent_version()
    if updates.started:
        messages.success(request, f"Updating the agent to {latest} on {_names(updates.started)}; Ray and the runtime keep running.")
    if updates.up_to_date:
        verb = "runs" if len(updates.up_to_date) == 1 else "run"
        messages.info(request, f"{_names(updates.up_to_date)} already {verb} agent {latest}.")
    say = messages.info if updates.started else messages.warning
    for why in updates.refused:
        say(request, why)


@require_POST
def machine_runtime_choose(request, pk: int):
    """The runtime card's form (htmx): the choice is saved, or refused with the sentence; either way the
    page is shown again with it at the top, and the card with what is now in use."""
    machine = get_object_or_404(Machine, pk=pk)
    try:
        machine = services.machine_runtime_choose(machine=machine, choice=request.POST.get("runtime_choice", ""),
                                                  user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, _runtime_saved(machine))
    url = machine.get_absolute_url()
    return HttpResponseClientRedirect(url) if request.htmx else redirect(url)


def _runtime_saved(machine: Machine) -> str:
    if machine.configured_runtime:
        return (f"Saved. The agent config on {machine.name} names the {machine.configured_runtime} driver, "
                "which it uses whatever is chosen.")
    in_use = machine.runtime
    words = f"{in_use.label} {in_use.version}".strip() if in_use else "no container runtime"
    return f"{machine.name} runs its clusters' containers with {words} from their next start."


@require_POST
def machine_trust_host_key(request, pk: int):
    machine = get_object_or_404(Machine, pk=pk)
    form = TrustHostKeyForm(request.POST)
    try:
        if not form.is_valid():
            raise ValidationError(form.errors["fingerprint"])
        services.machine_trust_host_key(machine=machine, fingerprint=form.cleaned_data["fingerprint"], user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, f"The host key of {machine.name} is trusted; enrolling it.")
    return redirect(machine)


def machine_delete(request, pk: int):
    machine = get_object_or_404(Machine, pk=pk)
    if request.method == "POST":
        try:
            services.machine_delete(machine=machine, user=request.user)
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
            return redirect(machine)
        messages.success(request, f"{machine.name} was deleted.")
        return redirect("machines:list")
    delete = actions.delete_offer(machine, role=roles.role_of(request.user))
    return render(request, "machines/machine_delete.html", {"machine": machine, "delete": delete})


# -- live cards ---------------------------------------------------------------------------


def may_see_machines_topic(user, arg: str) -> bool:
    """``machines`` (the list) or ``machines:summary`` (its counts)."""
    return arg in ("", "summary")


def render_machines_topic(arg: str, part: str, role: roles.Role) -> list[str]:
    """The list's live parts: the summary, then the rows (the first page, or the one that changed);
    they hold no buttons, so they read the same for every role.

    A row whose machine is new is added at the end of the table; one that was deleted is removed.
    ``machines:summary`` is the summary alone, for pages without the table.
    """
    context = {"summary": machine_summary(), "oob": True}
    if arg == "summary":  # services.SUMMARY_TOPIC
        return [render_to_string("machines/machine_list.html#summary", context)]
    if part.startswith("deleted-"):
        context["deleted_id"] = part.removeprefix("deleted-")
    elif part.startswith("new-"):
        context["machines"] = machine_list_queryset().filter(pk=int(part.removeprefix("new-")))
        context["new"] = True
    elif part:
        context["machines"] = machine_list_queryset().filter(pk=int(part))
    else:
        context["machines"] = machine_list_queryset()[:PAGE_SIZE]
    return [
        render_to_string("machines/machine_list.html#live-cards", context),
        render_to_string("machines/machine_list.html#live-rows", context),
    ]


def render_machine_topic(arg: str, part: str, role: roles.Role) -> list[str]:
    machine = Machine.objects.filter(pk=int(arg)).first()
    if machine is None:
        return []
    if part == "job":
        job = Job.objects.filter(target_type="machine", target_id=machine.pk).first()
        return [render_to_string("machines/machine_detail.html#job", {"machine": machine, "job": job, "oob": True})]
    return [render_to_string("machines/machine_detail.html#live", machine_cards(machine, role=role) | {"oob": True})]


def machine_detail_url(machine: Machine) -> str:
    return reverse("machines:detail", args=[machine.pk])
