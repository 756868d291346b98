from django.db import migrations, models


class Migration(migrations.Migration):
    """Whether each copy's engine serves mutual TLS, as it was started (copies started before read False)."""

    dependencies = [
        ('deployments', '0005_copy_key'),
    ]

    operations = [
        migrations.AddField(
            model_name='copy',
            name='tls',
            field=models.BooleanField(default=False, help_text="Its engine serves mutual TLS (the machine's copy certificate; it asks the gateway's and the checks' client certificate), as it was started"),
        ),
    ]
