"""Audits of the weights an engine serves: kept apart from applies (`Audited`), run and acted on (`Auditor`)."""
