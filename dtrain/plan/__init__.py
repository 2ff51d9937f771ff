"""Spec -> Plan, pure: variable placement over ps tasks (replica_device_setter's rules), replicas
onto worker tasks, tasks onto Dask workers, and the layout of each shard's flat buffer."""
