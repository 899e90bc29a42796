// Anchor of the tests' precompiled header (target kvc_test_pch).
