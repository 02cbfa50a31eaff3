"""The data plane: the ShardRuntime gRPC service, identity-bound TLS, relays."""
