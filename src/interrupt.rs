//! Ctrl-C handling: the first press asks long loops to stop at their next step; a second quits now.

use std::io::{IsTerminal, Write};
use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Exit status after an interrupt, as shells report a process ended by SIGINT.
pub const EXIT_INTERRUPTED: u8 = 130;

static PRESSES: AtomicUsize = AtomicUsize::new(0);
static INSTALL: Once = Once::new();

/// The error long-running commands return when the user pressed Ctrl-C.
#[derive(Debug, thiserror::Error)]
#[error("interrupted by Ctrl-C")]
pub struct Interrupted;

/// Puts the terminal back as we found it: cursor shown (progress bars hide it), line cleared.
pub fn restore_terminal() {
    let mut err = std::io::stderr();
    if err.is_terminal() {
        let _ = write!(err, "\r\x1b[2K\x1b[?25h");
        let _ = err.flush();
    }
}

/// Installs the handler once; later calls do nothing.
pub fn install() {
    INSTALL.call_once(|| {
        let installed = ctrlc::set_handler(|| {
            if PRESSES.fetch_add(1, Ordering::SeqCst) == 0 {
                restore_terminal();
                eprintln!(
                    "\ninterrupt: stopping after the current step (Ctrl-C again to quit now)"
                );
            } else {
                restore_terminal();
                eprintln!("\ninterrupted");
                std::process::exit(i32::from(EXIT_INTERRUPTED));
            }
        });
        // Without a handler Ctrl-C still ends the process, just not gracefully.
        if let Err(e) = installed {
            eprintln!("warning: cannot install the Ctrl-C handler: {e}");
        }
    });
}

/// True once the user has pressed Ctrl-C.
pub fn requested() -> bool {
    PRESSES.load(Ordering::SeqCst) > 0
}

/// `Err(Interrupted)` once the user has pressed Ctrl-C; call it between steps of long loops.
pub fn check() -> Result<(), Interrupted> {
    if requested() {
        Err(Interrupted)
    } else {
        Ok(())
    }
}

/// Forgets earlier presses: an interactive command that stopped one step on Ctrl-C goes on, and
/// the next press again asks it to stop rather than quitting.
pub fn reset() {
    PRESSES.store(0, Ordering::SeqCst);
}
