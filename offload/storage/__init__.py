"""The storage layer: host buffers and the per-tier ledger (`memory`), the C++ asynchronous I/O
(`aio`), swap files (`swap`), the buffers that carry state between tiers (`buffers`), and
`TierStore` (`tiers`), the one face the runtime uses."""
