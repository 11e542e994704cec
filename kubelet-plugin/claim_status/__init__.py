"""What each prepared claim holds, written to its ResourceClaim ``status.devices`` (KEP-4817):
`content` builds the entries, `writer` applies them. See docs/architecture.md#claim-status.
"""
