"""The audit trail (controlplane.audit.models.AuditEvent) and `record`, which actions call."""
