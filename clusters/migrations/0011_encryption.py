from django.db import migrations, models
import django.db.models.deletion


class Migration(migrations.Migration):
    """Encryption: clusters that exist keep running plain (False) until Encrypt; new ones start encrypted."""

    dependencies = [
        ('clusters', '0010_cluster_shared_files'),
    ]

    operations = [
        migrations.AddField(
            model_name='cluster',
            name='ray_tls',
            field=models.BooleanField(default=False, help_text="Ray between its machines uses TLS (certificates of the console's authority)"),
        ),
        migrations.AddField(
            model_name='cluster',
            name='model_tls',
            field=models.BooleanField(default=False, help_text='Its copies serve over mutual TLS to the gateway and the checks'),
        ),
        migrations.AlterField(
            model_name='cluster',
            name='ray_tls',
            field=models.BooleanField(default=True, help_text="Ray between its machines uses TLS (certificates of the console's authority)"),
        ),
        migrations.AlterField(
            model_name='cluster',
            name='model_tls',
            field=models.BooleanField(default=True, help_text='Its copies serve over mutual TLS to the gateway and the checks'),
        ),
        migrations.CreateModel(
            name='MemberCertificate',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('role', models.CharField(choices=[('node', 'Ray node'), ('copy', 'Copy server')], max_length=8)),
                ('address', models.CharField(help_text='The address it names', max_length=64)),
                ('serial', models.CharField(help_text='Its serial number, hex', max_length=64)),
                ('issued_at', models.DateTimeField()),
                ('not_after', models.DateTimeField(help_text='When it expires')),
                ('ray_not_after', models.DateTimeField(blank=True, help_text='When the certificate Ray started with expires', null=True)),
                ('member', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='certificates', to='clusters.clustermember')),
            ],
            options={
                'ordering': ['member', 'role'],
                'constraints': [models.UniqueConstraint(fields=('member', 'role'), name='one_certificate_per_member_role')],
            },
        ),
    ]
