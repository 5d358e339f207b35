//! Calibration text: Brown detection and detagging, directory walks, UTF-8 handling, path errors.

use std::path::{Path, PathBuf};

use ridgefill_io::IoError;
use ridgefill_io::text::{
    Document, TextKind, collect_documents, detag_brown, detect_kind, read_text_file,
};
use ridgefill_testkit::assert_names;

/// The first three sentences of Brown file ca01, byte for byte (tab-indented sentences, blank lines between).
const CA01_HEAD: &str = "\n\n\tThe/at Fulton/np-tl County/nn-tl Grand/jj-tl Jury/nn-tl said/vbd Friday/nr an/at investigation/nn of/in Atlanta's/np$ recent/jj primary/nn election/nn produced/vbd ``/`` no/at evidence/nn ''/'' that/cs any/dti irregularities/nns took/vbd place/nn ./.\n\n\n\tThe/at jury/nn further/rbr said/vbd in/in term-end/nn presentments/nns that/cs the/at City/nn-tl Executive/jj-tl Committee/nn-tl ,/, which/wdt had/hvd over-all/jj charge/nn of/in the/at election/nn ,/, ``/`` deserves/vbz the/at praise/nn and/cc thanks/nns of/in the/at City/nn-tl of/in-tl Atlanta/np-tl ''/'' for/in the/at manner/nn in/in which/wdt the/at election/nn was/bedz conducted/vbn ./.\n\n\n\tThe/at September-October/np term/nn jury/nn had/hvd been/ben charged/vbn by/in Fulton/np-tl Superior/jj-tl Court/nn-tl Judge/nn-tl Durwood/np Pye/np to/to investigate/vb reports/nns of/in possible/jj ``/`` irregularities/nns ''/'' in/in the/at hard-fought/jj primary/nn which/wdt was/bedz won/vbn by/in Mayor-nominate/nn-tl Ivan/np Allen/np Jr./np ./.\n";

/// What `scripts/make_score_text.py` prints for [`CA01_HEAD`].
const CA01_PLAIN: &str = "The Fulton County Grand Jury said Friday an investigation of Atlanta's recent primary election produced \" no evidence \" that any irregularities took place .\nThe jury further said in term-end presentments that the City Executive Committee , which had over-all charge of the election , \" deserves the praise and thanks of the City of Atlanta \" for the manner in which the election was conducted .\nThe September-October term jury had been charged by Fulton Superior Court Judge Durwood Pye to investigate reports of possible \" irregularities \" in the hard-fought primary which was won by Mayor-nominate Ivan Allen Jr. .\n";

/// Plain English with the slashes prose does have (`and/or`, `w/o`, a URL, a fraction).
const PLAIN: &str = "The committee met on Tuesday and/or Wednesday to review the budget.\n\
    Members w/o a badge were turned away; details are at https://example.org/minutes/2024.\n\
    About 1/2 of the seats stayed empty, which surprised nobody who had read the agenda beforehand.\n";

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn write(path: &Path, bytes: impl AsRef<[u8]>) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn detects_brown_and_not_plain() {
    assert_eq!(detect_kind(CA01_HEAD), TextKind::BrownTagged);
    assert_eq!(detect_kind(PLAIN), TextKind::Plain);
    assert_eq!(detect_kind(CA01_PLAIN), TextKind::Plain);
    assert_eq!(detect_kind(""), TextKind::Plain);
    // A short plain text made only of slashed words is too little evidence.
    assert_eq!(detect_kind("and/or input/output"), TextKind::Plain);
    // Brown with a CRLF file ending and odd tags (`np$`, `md*`, `ppss+ber`, `--`) is still Brown.
    let odd = "\tHe/pps couldn't/md* say/vb --/-- I'm/ppss+bem sure/jj ,/, John's/np$ Input/Output/jj-tl \
               ran/vbd (/( fast/rb )/) ;/. 1/2/cd ://: Mr./np-tl ok/uh ./.\r\n";
    assert_eq!(detect_kind(odd), TextKind::BrownTagged);
}

#[test]
fn detags_like_the_python_script() {
    assert_eq!(detag_brown(CA01_HEAD), CA01_PLAIN);
    // The tag goes from the last slash: slashed words keep their own slash.
    assert_eq!(
        detag_brown("and/or/cc 1/2''/nn //in\r\n\n  x/nn  y/nn  \n"),
        "and/or 1/2'' /\nx y\n"
    );
    assert_eq!(detag_brown("\n\n\t\n"), "");
}

#[test]
fn reads_utf8_and_reports_bad_bytes() {
    let dir = tmp();
    let good = dir.path().join("good.txt");
    write(&good, "\u{feff}naïve café\n");
    assert_eq!(read_text_file(&good, false).unwrap(), "naïve café\n");

    let bad = dir.path().join("bad.txt");
    write(&bad, b"hello \xff world\n");
    let err = read_text_file(&bad, false).unwrap_err();
    assert!(matches!(err, IoError::NotUtf8 { offset: 6, .. }), "{err:?}");
    assert_names(&err, &bad, &["UTF-8", "byte offset 6"]);
    assert_eq!(
        read_text_file(&bad, true).unwrap(),
        "hello \u{fffd} world\n"
    );

    // The same file inside a directory: the error names the file, and lossy mode reads it.
    let err = collect_documents(&[dir.path().to_path_buf()], false).unwrap_err();
    assert_names(&err, &bad, &["byte offset 6"]);
    let docs = collect_documents(&[dir.path().to_path_buf()], true).unwrap();
    assert_eq!(docs[0].text, "hello \u{fffd} world\n");
}

#[test]
fn walks_directories_sorted_and_skips_non_text() {
    let dir = tmp();
    let root = dir.path().join("corpus");
    write(&root.join("cb01"), "second file\n");
    write(&root.join("ca01"), CA01_HEAD);
    write(&root.join("sub/a.txt"), "inside a folder\n");
    write(&root.join("sub/.hidden"), "hidden\n");
    write(&root.join(".git/config"), "hidden folder\n");
    write(&root.join("README"), "about the corpus\n");
    write(&root.join("LICENSE-MIT"), "licence\n");
    write(&root.join("readme.txt"), "about the corpus\n");
    write(&root.join("package.json"), "{}\n");
    write(&root.join("notes.md"), "# notes\n");
    write(&root.join("index.js"), "module.exports = 1;\n");
    write(&root.join("empty.txt"), "");
    write(&root.join("blank.txt"), " \n\t\n");
    let single = dir.path().join("single.txt");
    write(&single, PLAIN);

    let docs = collect_documents(&[root.clone(), single.clone()], false).unwrap();
    let sources: Vec<&str> = docs.iter().map(|d| d.source.as_str()).collect();
    let expected: Vec<String> = [
        root.join("ca01"),
        root.join("cb01"),
        root.join("sub/a.txt"),
        single.clone(),
    ]
    .iter()
    .map(|p| p.display().to_string())
    .collect();
    assert_eq!(sources, expected);
    assert_eq!(docs[0].text, CA01_PLAIN);
    assert_eq!(
        docs[3],
        Document {
            source: single.display().to_string(),
            text: PLAIN.to_string(),
        }
    );
}

#[test]
fn missing_and_empty_paths_are_errors() {
    let dir = tmp();
    let missing = dir.path().join("no-such-corpus");
    let err = collect_documents(std::slice::from_ref(&missing), false).unwrap_err();
    assert!(matches!(err, IoError::MissingFile { .. }), "{err:?}");
    assert_names(&err, &missing, &["no such file or directory"]);

    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = collect_documents(std::slice::from_ref(&empty), false).unwrap_err();
    assert!(matches!(err, IoError::NoText { .. }), "{err:?}");
    assert_names(
        &err,
        &empty,
        &["no calibration text", "no non-empty text file"],
    );

    // Only skipped or blank files count as empty too.
    write(&empty.join("README.md"), "about\n");
    write(&empty.join("blank.txt"), "\n\n");
    let err = collect_documents(std::slice::from_ref(&empty), false).unwrap_err();
    assert_names(&err, &empty, &["no calibration text"]);

    let blank = dir.path().join("blank.txt");
    write(&blank, "   \n");
    let err = collect_documents(&[PathBuf::from(&blank)], false).unwrap_err();
    assert_names(&err, &blank, &["empty or blank"]);

    let err = collect_documents(&[], false).unwrap_err();
    assert!(matches!(err, IoError::NoText { .. }), "{err:?}");
}
