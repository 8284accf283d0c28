# Existing routes keep the lease_patience they have; only new routes default to auto (null).

from django.db import migrations, models

import routing.models


class Migration(migrations.Migration):

    dependencies = [
        ('routing', '0008_route_open_host_controls'),
    ]

    operations = [
        migrations.AlterField(
            model_name='route',
            name='lease_patience',
            field=models.FloatField(blank=True, default=None, help_text='Seconds a conversation waits for its own (cache-warm) host before it goes to another host with a free slot. 0: never wait while another host is free. Empty: auto, whichever is sooner: the wait in line at home, or the prompt evaluated cold on the other host, as the hosts\' recent answers price them.', null=True, validators=[routing.models.validate_seconds]),
        ),
    ]
