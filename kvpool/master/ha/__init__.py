"""Master high availability on etcd: leader election (`election`) and the standby's door (`gate`)."""
