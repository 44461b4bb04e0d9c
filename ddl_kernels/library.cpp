// The library's identity: the digest of the sources and flags it was built from (ddl_kernels/extension.py), which the
// loader compares with those of the sources beside it, so that a build of other sources is never run.
extern "C" const char* ddl_sources_digest() { return DDL_SOURCES_DIGEST; }
