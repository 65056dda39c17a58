//! The `lwio` command-line tool: `serve`, `mount`-free data commands (`cat`,
//! `cp`), namespace commands (`ls`, `stat`, `mkdir`, `rm`), `bench` and
//! `rdma-bench`. The client library is `lwio-client`, the server
//! `lwio-server`, the side channel both share `lwio-side`.

pub mod cli;
pub mod cmd;
pub mod scale;
