from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('accounting', '0006_request_cached_blocks'),
    ]

    operations = [
        migrations.AddField(
            model_name='request',
            name='patience',
            field=models.CharField(blank=True, choices=[('stay', 'stay'), ('spill', 'spill'), ('default', 'default'), ('', 'none')], help_text='What priced patience chose for a request that waited; empty when it did not price the wait.', max_length=10),
        ),
        migrations.AddField(
            model_name='request',
            name='patience_stay_ms',
            field=models.PositiveIntegerField(blank=True, help_text="The expected ms to the first token staying in line (the wait, then the prompt's uncached part); empty when a figure was missing.", null=True, verbose_name='patience stay ms'),
        ),
        migrations.AddField(
            model_name='request',
            name='patience_spill_ms',
            field=models.PositiveIntegerField(blank=True, help_text="The expected ms to the first token on the other host's free slot (its prefill of what it does not hold); empty when a figure was missing or nothing was free.", null=True, verbose_name='patience spill ms'),
        ),
    ]
