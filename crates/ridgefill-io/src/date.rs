//! Civil dates from the system clock, formatted strftime-style: chat templates' `strftime_now`
//! and the dates in `bench` reports. Hand-written: a dozen lines of Hinnant's algorithm against a
//! date crate for two callers.

use std::time::{SystemTime, UNIX_EPOCH};

const SECONDS_PER_DAY: i64 = 86_400;
const SECONDS_PER_HOUR: i64 = 3_600;
const SECONDS_PER_MINUTE: i64 = 60;
/// 12-hour clock for %I / %p.
const HOURS_PER_HALF_DAY: i64 = 12;
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
/// 1970-01-01 was a Thursday (index 3 from Monday).
const EPOCH_WEEKDAY: i64 = 3;
/// Abbreviated month/day names are the first three letters.
const ABBREV: usize = 3;

/// The current UTC time formatted with the common strftime directives.
pub fn strftime_now(fmt: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(fmt, secs)
}

/// `unix_secs` (UTC) formatted with the strftime directives `%Y %y %m %d %e %H %I %p %M %S %B
/// %b %h %A %a %%` (chat templates' `strftime_now`, report headers).
pub fn strftime(fmt: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(SECONDS_PER_DAY);
    let rem = unix_secs.rem_euclid(SECONDS_PER_DAY);
    let (year, month, day) = civil_from_days(days);
    let hour = rem / SECONDS_PER_HOUR;
    let minute = rem % SECONDS_PER_HOUR / SECONDS_PER_MINUTE;
    let second = rem % SECONDS_PER_MINUTE;
    let weekday = (days + EPOCH_WEEKDAY).rem_euclid(WEEKDAYS.len() as i64) as usize;
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!(
                "{:02}",
                (hour + HOURS_PER_HALF_DAY - 1) % HOURS_PER_HALF_DAY + 1
            )),
            Some('p') => out.push_str(if hour < HOURS_PER_HALF_DAY {
                "AM"
            } else {
                "PM"
            }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..ABBREV]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..ABBREV]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    const DAYS_TO_0000_03_01: i64 = 719_468;
    const DAYS_PER_ERA: i64 = 146_097;
    let z = days + DAYS_TO_0000_03_01;
    let era = z.div_euclid(DAYS_PER_ERA);
    let doe = z.rem_euclid(DAYS_PER_ERA);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_date() {
        // 2024-02-29 13:05:09 UTC was a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A %%", t),
            "29 Feb 2024 13:05:09 Thursday %"
        );
    }
}
