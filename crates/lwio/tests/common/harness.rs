//! `main` of a `harness = false` test with one test in it (e2e_thousand,
//! e2e_hundred_thousand): libtest's arguments that matter here are name
//! filters, `--exact`, `--skip`, `--list` and `--ignored` (the test is not
//! ignored); others are accepted and ignored (and the value of those that
//! take one skipped). Included with `#[path]`, not through `common`.

/// Run `test` as the test `name` unless the command line filters it out.
pub fn run(name: &str, test: impl FnOnce()) {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        println!("{name}: test");
        return;
    }
    let exact = args.iter().any(|a| a == "--exact");
    let matches = |f: &str| if exact { f == name } else { name.contains(f) };
    let (mut filters, mut skipped, mut it) = (Vec::new(), false, args.iter());
    while let Some(a) = it.next() {
        match a.as_str() {
            "--skip" => skipped |= it.next().is_some_and(|f| matches(f)),
            "--test-threads" | "--format" | "--color" | "--logfile" | "--shuffle-seed" | "-Z" => {
                it.next();
            }
            "--ignored" => skipped = true,
            f if !f.starts_with('-') => filters.push(f),
            _ => {}
        }
    }
    if skipped || !(filters.is_empty() || filters.iter().any(|f| matches(f))) {
        println!("running 0 tests ({name} filtered out)");
        return;
    }
    println!("running 1 test");
    test();
    println!("test {name} ... ok");
}
