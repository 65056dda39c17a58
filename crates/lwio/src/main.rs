//! The `lwio` command-line tool. See `lwio --help`.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // A bug must still end in one line, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("lwio: internal error: {msg}{at} (please report this)");
    }));
    // mount(8) runs a `fuse.lwio` (or `lwio#URL`) line of /etc/fstab as
    // `lwio URL MOUNTPOINT -o OPTIONS`: that is `lwio mount --daemon …`.
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args
        .get(1)
        .and_then(|a| a.to_str())
        .is_some_and(|a| a.starts_with("lwio://"))
    {
        args.splice(1..1, ["mount".into(), "--daemon".into()]);
    }
    let cli = match lwio::cli::Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            // A bad value (URL, size, duration) is one actionable line; other
            // usage errors, --help and --version are clap's.
            if e.kind() == clap::error::ErrorKind::ValueValidation {
                if let Some(src) = std::error::Error::source(&e) {
                    eprintln!("lwio: error: {src}");
                    return ExitCode::from(2);
                }
            }
            e.exit();
        }
    };
    match lwio::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if let Some(r) = e.downcast_ref::<lwio::cli::Reported>() {
                return ExitCode::from(r.0);
            }
            eprintln!("lwio: error: {}", lwio::cli::error_line(&e));
            ExitCode::FAILURE
        }
    }
}
