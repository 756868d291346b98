from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('clusters', '0009_nccl_test'),
    ]

    operations = [
        migrations.AddField(
            model_name='cluster',
            name='shared_files',
            field=models.JSONField(blank=True, default=dict, help_text='How /shared is shared: the method, and who is left out'),
        ),
    ]
