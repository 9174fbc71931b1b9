"""Scale-out beyond one host: the facegate engine as Ray Serve replicas (optional extra ``ray``)."""
