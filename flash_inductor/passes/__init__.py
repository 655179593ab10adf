"""The Inductor pre-grad pass: one module per pattern family, the CustomGraphPass, the report."""
