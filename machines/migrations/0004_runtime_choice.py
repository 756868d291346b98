"""Machines record every container runtime found, the administrator's choice and the runtime in use.

Rows enrolled before this read their last facts once: the engines found and the config's driver, and
the runtime in use by the rule of machines/runtimes.py (automatic, no choice yet)."""
from django.db import migrations, models

from machines import runtimes


def runtimes_from_facts(apps, schema_editor):
    Machine = apps.get_model("machines", "Machine")
    for machine in Machine.objects.exclude(facts={}).iterator(chunk_size=500):
        found = runtimes.found_in(machine.facts)
        configured = runtimes.configured_in(machine.facts)
        in_use = runtimes.in_use(configured=configured, found=found, choice="")
        machine.container_runtimes = [r.as_dict() for r in found]
        machine.configured_runtime = configured.name if configured else ""
        machine.container_runtime = in_use.name if in_use else ""
        machine.container_runtime_version = in_use.version if in_use else ""
        machine.save(update_fields=["container_runtimes", "configured_runtime", "container_runtime",
                                    "container_runtime_version"])


class Migration(migrations.Migration):

    dependencies = [
        ('machines', '0003_recent_indexes'),
    ]

    operations = [
        migrations.AddField(
            model_name='machine',
            name='configured_runtime',
            field=models.CharField(blank=True, help_text="The driver the machine's agent config names (the lab's process), if any", max_length=64),
        ),
        migrations.AddField(
            model_name='machine',
            name='container_runtime_version',
            field=models.CharField(blank=True, max_length=64),
        ),
        migrations.AddField(
            model_name='machine',
            name='container_runtimes',
            field=models.JSONField(blank=True, default=list, help_text='Every engine the agent found: [{name, version}]'),
        ),
        migrations.AddField(
            model_name='machine',
            name='runtime_choice',
            field=models.CharField(blank=True, choices=[('', 'Automatic'), ('docker', 'Docker'), ('podman', 'Podman')], default='', help_text="The administrator's choice among the engines found; empty: automatic", max_length=16),
        ),
        migrations.AlterField(
            model_name='machine',
            name='container_runtime',
            field=models.CharField(blank=True, help_text='The container runtime in use; empty: none', max_length=64),
        ),
        migrations.AlterField(
            model_name='machineevent',
            name='kind',
            field=models.CharField(choices=[('state', 'State change'), ('reconnected', 'Reconnected'), ('host_key', 'Host key'), ('facts', 'Facts'), ('runtime', 'Container runtime')], max_length=16),
        ),
        migrations.RunPython(runtimes_from_facts, migrations.RunPython.noop),
    ]
