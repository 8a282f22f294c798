"""Moved to grpo_launcher/secrets.py (the Plan, the driver and the tracker use it too); re-exported for the
imports that still name launch.secrets (older scripts and tests)."""

from __future__ import annotations

from ..secrets import (  # noqa: F401 (re-exported)
    REDACTED,
    SECRETS_FILE,
    has_secret,
    is_secret_key,
    load_secrets,
    redact_text,
    redact_value,
    save_secrets,
    secret_values,
    with_http_api_key,
    write_private,
)
