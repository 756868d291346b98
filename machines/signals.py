"""What machines tell the apps that depend on them (machines import nothing from those apps)."""
from django.dispatch import Signal

# Sent inside the heartbeat's transaction when an Offline machine comes back: machine_id, name.
machine_reconnected = Signal()

# Sent inside the transaction that marks a machine Offline (no heartbeat): machine_id, name.
machine_went_offline = Signal()
