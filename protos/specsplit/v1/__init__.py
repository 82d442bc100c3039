"""specsplit.protos.v1 (proto package specsplit.v1): common types, DrafterService and TargetService; regenerate with tools/gen_protos.sh."""
