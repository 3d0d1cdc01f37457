"""The replica-side KV block cache: plan, restore and capture prompt prefixes."""
