"""Admission: the app's KV-aware queue (one FIFO by service level, exact per-replica KV accounting, grants), its
fairness, tenant limits, replica choice, prefix routing and layout pools, and KvAdmission, its Serve deployment."""
