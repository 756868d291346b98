"""What machines tell the apps that depend on them (machines import nothing from those apps)."""
from django.dispatch import Signal

# Sent inside the heartbeat's transaction when an Offline machine comes back: machine_id, name.
machine_reconnected = Signal()

# Sent inside the transaction that marks a machine Offline (no heartbeat): machine_id, name.
machine_went_offline = Signal()

# Sent inside the heartbeat's transaction when the runtime section of a beat (machines/beats.py)
# changed or reports a failure: machine_id, name, failure (words, '' when none), failing_since (when
# its beats began to report it, None when none). Not sent for the beat that brings a machine back
# (machine_reconnected covers it), nor for a healthy beat like the one before it.
machine_runtime_reported = Signal()

# Sent inside the heartbeat's transaction when a GPU that a process the console did not start was using (a
# person's own job) is free of such processes again: machine_id. Room for copies that wait for it.
machine_gpus_freed = Signal()
