"""The engine replica: one Serve replica = one engine = one TP x DCP (x PCP) worker group."""
